"""Serve tidal's policy to agents written against other APIs (``docs/harness.md``): an OpenAI-compatible
HTTP endpoint whose completions are recorded with exact token ids, behaviour log-probs and versions."""
