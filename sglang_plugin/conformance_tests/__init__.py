"""The plugin on SGLang's own PD code, one release per process (see scripts/conformance.sh)."""
