import pytest


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory, small_model, tokenizer):
    """The session's random tiny model saved as a Hugging Face directory (what curation blocks load)."""
    path = tmp_path_factory.mktemp("small_model")
    small_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
