"""Engine integrations: an SGLang transfer backend and a vLLM KV connector, each importable
only when its engine is installed (`pip install kvhandoff[sglang]` / `kvhandoff[vllm]`)."""
