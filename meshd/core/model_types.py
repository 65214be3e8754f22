"""Model types as modelmesh-serving names them, and what serves each: the MLServer runtime
class and the Triton backend (with the file the backend looks for in a version folder).
Shared by `meshd adapter` (laying a model out for its server) and the daemon's model
repository directory (telling a folder's type from its server config).
"""

import json
from typing import Any

# Model type (lower case) -> MLServer runtime class, as modelmesh-serving's runtimes name them.
MLSERVER_IMPLEMENTATIONS = {
    "sklearn": "mlserver_sklearn.SKLearnModel",
    "xgboost": "mlserver_xgboost.XGBoostModel",
    "lightgbm": "mlserver_lightgbm.LightGBMModel",
    "mlflow": "mlserver_mlflow.MLflowRuntime",
    "huggingface": "mlserver_huggingface.HuggingFaceRuntime",
    # Upstream writes "mlserver-mllib.MLlibModel", which Python cannot import; this is the class.
    # MLlib also needs `parameters.format`, which no file tells: bring a model-settings.json.
    "mllib": "mlserver_mllib.MLlibModel",
}

# Model type -> (Triton backend, the name a single model file takes in the version folder).
TRITON_BACKENDS = {
    "onnx": ("onnxruntime", "model.onnx"),
    "pytorch": ("pytorch", "model.pt"),
    "tensorflow": ("tensorflow", "model.graphdef"),  # a file is a GraphDef; a folder, below
    "tensorrt": ("tensorrt", "model.plan"),
    "python": ("python", "model.py"),
}
# Model type -> the name a model *folder* takes in the version folder (upstream triton
# adapter's modelTypeToDirNameMapping); other types' folders are the version folder's contents.
TRITON_FOLDER_NAMES = {"tensorflow": "model.savedmodel", "onnx": "model.onnx", "keras": "model.savedmodel"}
# Keras is served as a TensorFlow SavedModel (upstream). A single Keras file (.h5) upstream
# converts with a TensorFlow tool the adapter does not ship, so it is refused.
TRITON_KERAS = "keras"


def triton_backend(model_type: str) -> str | None:
    """The Triton backend serving a model type (None: unknown)."""
    if model_type == TRITON_KERAS:
        return TRITON_BACKENDS["tensorflow"][0]
    known = TRITON_BACKENDS.get(model_type)
    return known[0] if known else None


# Model types served by an LLM engine (`meshd llm-runtime`): OpenAI calls and KServe text
# completions go to these; a model of any other type is a tensor model, and an OpenAI call
# naming it is answered 400 before anything loads. "lora" is an adapter on a base model.
LLM_MODEL_TYPES = frozenset({"llm", "gguf", "llamacpp", "vllm", "sglang", "ollama", "lora"})


def is_llm_type(model_type: str) -> bool:
    return model_type.lower() in LLM_MODEL_TYPES


# A LoRA adapter names its base model in its key: {"meshd": {"base_model": "<model id>"}}. It
# loads only where its base is loaded, into the base's engine, and takes one of its slots.
ADAPTER_TYPE = "lora"
# How a runtime says the base's engine holds all the adapters it takes (RESOURCE_EXHAUSTED):
# meshd then evicts one of them and loads again.
ADAPTER_SLOTS_FULL = "adapter slots full"


def key_object(key: str) -> dict[str, Any] | None:
    """The model key as a JSON object, or None when it is not one (keys are opaque to meshd,
    JSON by convention; too deeply nested JSON counts as not an object)."""
    if not key or not key.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(key)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def base_model_of(key: str) -> str | None:
    """The base model an adapter's key names (None: not an adapter, or no such field)."""
    obj = key_object(key)
    own = obj.get("meshd") if obj is not None else None
    base = own.get("base_model") if isinstance(own, dict) else None
    return base if isinstance(base, str) and base else None
