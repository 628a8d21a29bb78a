"""The KV pool: block keys, the Mooncake Store client, the vLLM KV connector, the master
launcher."""
