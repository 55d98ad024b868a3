"""capplan's hooks on vLLM's Model Runner V2, one module per concern; each module's `HOOKS`
are entries of the registry (capplan.runtime.registry), which alone installs them."""
