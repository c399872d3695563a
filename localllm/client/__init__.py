"""The apps' one client interface (`Client`): the in-process engine or a remote server."""

from localllm.client.base import (
    Client,
    ClientError,
    ContextOverflow,
    Delta,
    Message,
    Usage,
    collect,
)

__all__ = ["Client", "ClientError", "ContextOverflow", "Delta", "Message", "Usage", "collect"]
