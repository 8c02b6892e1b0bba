"""Pooling (embedding) models, as vLLM's pooling runner serves them: the runner returns each prompt's pooled final
hidden state instead of sampling (params.py: per request; config.py: per engine, --runner / --convert / --task /
--pooler-config; pooler.py: the device side)."""
