"""benchmarks/results/ holds the measurements the docs cite, and benchmarks/results/INDEX.md lists them
(benchmarks/results_index.py): the index is current, every result file is cited, every cited path exists."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_index", REPO / "benchmarks" / "results_index.py")
results_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_index)


def test_index_is_up_to_date():
    assert results_index.INDEX.read_text() == results_index.render(), \
        "benchmarks/results/INDEX.md is out of date: run python benchmarks/results_index.py"


def test_every_result_file_is_cited():
    texts = results_index._citing_texts()
    uncited = [rel for rel in results_index.result_files() if not results_index.citations(rel, texts)]
    assert not uncited, f"result files nothing cites (delete them; git keeps them): {uncited}"


def test_every_cited_result_exists():
    missing = {path: pages for path, pages in results_index.cited_paths(results_index._citing_texts()).items()
               if not (REPO / path).exists() and not list(REPO.glob(path + "*"))}
    assert not missing, f"cited but not in benchmarks/results: {missing}"


def test_description_reads_notes_and_json(tmp_path):
    info = results_index.describe("crossover_h200.json")
    assert info["date"] == "2026-12-02" and "H200" in info["hardware"] and "crossover" in info["command"]
    assert results_index.citations("crossover_h200.png", {"page.md": "see benchmarks/results/crossover_h200.*"})
    assert not results_index.citations("cpu.json", {"page.md": "benchmarks/results/cpu_threads_under_load.txt"})
