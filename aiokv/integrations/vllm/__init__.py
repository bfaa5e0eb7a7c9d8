"""aiokv as a vLLM KV connector (``kv_connector_module_path: "aiokv.integrations.vllm"``)."""
