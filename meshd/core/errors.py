"""Errors that carry the gRPC status a client should see; transports map them at the edge."""

from __future__ import annotations

import grpc


class MeshError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(MeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MeshError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MeshError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(MeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(MeshError):
    """Retryable: the registry, the runtime or every copy is unreachable for now."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(MeshError):
    """Too many requests queued for a model's copies (its concurrency limits)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(MeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(MeshError):
    """A stored record cannot be decoded; it is reported and left untouched."""

    code = grpc.StatusCode.DATA_LOSS


class LoadFailed(MeshError):
    """The runtime failed to load the model (recorded in the model record)."""

    code = grpc.StatusCode.UNAVAILABLE


class ModelLoadError(MeshError):
    """A model that failed to load wherever it was tried: upstream answers INTERNAL with the
    runtime's message (churn and capacity stay UNAVAILABLE: those are worth retrying)."""

    code = grpc.StatusCode.INTERNAL


class RuntimeStatusError(MeshError):
    """A status the runtime answered with, passed through to the client unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# How model servers say "no such model": NOT_FOUND (MLServer >= 1.x, the reference runtime),
# Triton's UNAVAILABLE "Request for unknown model", older MLServers' INVALID_ARGUMENT
# "Model ... not found". Code and phrase together, so a transport error ("Domain name not
# found") is never read as a missing model.
def means_model_missing(code: grpc.StatusCode, details: str) -> bool:
    """Whether a model server's error may mean it does not hold the model (to be confirmed)."""
    text = details.lower()
    if code == grpc.StatusCode.NOT_FOUND:
        return True
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unknown model" in text
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return text.startswith("model ") and "not found" in text
    return False
