"""Text handling: tokenizer, chat templates, incremental detokenizer and stop strings."""

from localllm.text.chat_template import ChatTemplate
from localllm.text.detokenizer import IncrementalDetokenizer, StopChecker
from localllm.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopChecker", "Tokenizer"]
