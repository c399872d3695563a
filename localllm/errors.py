"""User-facing errors: each carries one line that says what is wrong and what to do."""


class LocalLLMError(Exception):
    """Base class for errors shown to a user as one line, without a traceback."""


class ModelLoadError(LocalLLMError):
    """A model file is missing, unreadable, corrupt, truncated or unsupported."""


class TemplateError(LocalLLMError):
    """A chat template failed to render."""


class RequestError(LocalLLMError):
    """A request is invalid (for example a prompt longer than the context)."""


class PromptTooLong(RequestError):
    """A prompt does not fit the context or the KV cache (API clients shorten it on this)."""
