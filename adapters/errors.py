"""Exceptions for everything a user can get wrong about an adapter.

Every adapter problem raises a subclass of :class:`AdapterError`, so callers can catch one class.
Messages name the adapter, the offending file/key/field, and what is supported.
"""


class AdapterError(Exception):
    """Base class of every adapter problem (not found, invalid, too large, unsupported)."""


class AdapterNotFoundError(AdapterError):
    """The directory, Hub repo, revision or a required file does not exist."""


class InvalidAdapterError(AdapterError):
    """The checkpoint is malformed: bad config, corrupt weights, wrong shapes, NaN/inf, missing keys."""


class AdapterTooLargeError(AdapterError):
    """The adapter exceeds a configured limit (rank, virtual tokens, file bytes)."""


class CPUCacheBoundError(AdapterTooLargeError):
    """The adapter alone holds more bytes than the whole LoRA CPU cache may (``max_cpu_lora_bytes``).

    Only this adapter is refused: the requests for it fail, every other request goes on."""


class UnsupportedAdapterError(AdapterError):
    """A valid PEFT checkpoint that uses a feature this engine does not implement (DoRA, bias, ...)."""


class AdapterCapacityError(AdapterError):
    """A step needs more distinct adapters than there are device slots, or every slot is pinned."""


class UnknownAdapterError(AdapterError, KeyError):
    """An operation (remove, pin, unpin) named an adapter the manager does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsafeAdapterError(AdapterError):
    """Loading would need unpickling, which is refused unless the user opted in (allow_pickle=True)."""
