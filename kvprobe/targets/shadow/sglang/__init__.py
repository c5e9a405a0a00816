"""The SGLang shadow: real `sglang.launch_server` with kvprobe's model-less plugin."""
