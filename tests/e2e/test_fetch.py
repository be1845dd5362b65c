"""Engines by URL on one host: a copy fetched from a static file server on loopback into Kiln's cache, every hashed
file checked (rank files and tokenizer files alike); a source whose tokenizer was changed after the build is refused
in one line with nothing kept, and a cached copy changed later is named with the folder to remove."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from pathlib import Path

import pytest
from conftest import exact_plan

from builder.build import build_engine
from runtime.backends.fetch import local_engine
from runtime.format.engine_format import EngineError, Manifest


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    """(the folder a file server on 127.0.0.1 serves, its URL): a tiny engine in it as `engine`."""
    root = tmp_path_factory.mktemp("served")
    build_engine(str(tiny_llama_dir), exact_plan(method="none"), root / "engine", show_progress=False)
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_a_url_engine_is_fetched_checked_and_cached_by_build_id(served, tmp_path, monkeypatch):
    root, url = served
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    copy = Path(local_engine(f"{url}/engine"))
    manifest = Manifest.read(root / "engine")
    assert copy == tmp_path / "engines" / manifest.build_id
    assert {name for name, _ in manifest.tokenizer_files} == {"tokenizer.json", "tokenizer_config.json",
                                                              "generation_config.json"}
    for name in ("rank0.engine", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (copy / name).read_bytes() == (root / "engine" / name).read_bytes()
    assert local_engine(f"{url}/engine") == str(copy)  # the cached copy, checked again
    (copy / "tokenizer_config.json").write_text("{}")
    with pytest.raises(EngineError, match=rf"tokenizer_config\.json: the cached copy .* remove {copy}"):
        local_engine(f"{url}/engine")


def test_a_source_whose_tokenizer_changed_after_the_build_is_refused_and_nothing_kept(served, tmp_path, monkeypatch):
    root, url = served
    shutil.copytree(root / "engine", root / "edited")
    config = json.loads((root / "edited" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (root / "edited" / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    with pytest.raises(EngineError, match=r"edited/tokenizer_config\.json: sha256 does not match .* nothing was kept"):
        local_engine(f"{url}/edited")
    assert not any((tmp_path / "engines").iterdir())
