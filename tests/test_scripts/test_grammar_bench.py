"""scripts/grammar_bench.py runs on the engine as it is (it once patched a name that had moved)."""

from __future__ import annotations

from streaming_backend.sampling import logits


def test_the_bench_measures_every_run_and_restores_the_pipeline(
    load_script, tiny_model_dir, capsys
):
    """Free, masks after and masks ahead each generate every token; constrained runs report
    their mask time; the logits pipeline's apply_grammar_masks is the real one afterwards."""
    bench = load_script("grammar_bench")
    original = logits.apply_grammar_masks
    argv = ["--model", str(tiny_model_dir), "--streams", "2", "--tokens", "6", "--rounds", "1"]
    result = bench.main([*argv, "--dtype", "float32"])
    assert result["tokens"] == {"free": [12], "json": [12], "json_ahead": [12]}
    assert set(result["mask"]) == {"json", "json_ahead"}
    assert all(figures["us_per_token"] > 0 for figures in result["mask"].values())
    assert logits.apply_grammar_masks is original
    assert '"ratio_to_free"' in capsys.readouterr().out
