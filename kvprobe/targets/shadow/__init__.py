"""The real engines without a model: engine environments, model folders, the model-less vLLM worker
and the SGLang plugin. Code here that runs *inside* an engine's processes (the worker, the plugin)
imports only the standard library, the engine and `kvprobe.theory`."""
