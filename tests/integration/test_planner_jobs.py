"""Property tests of the planner's invariants over random streams and configs."""


def test_plan_stats_command_counts_what_moves(small_binary, capsys):
    import json

    from bagpipe.cli import main

    results = {}
    for policy in ("lookahead", "belady", "lru", "none"):
        assert main(["plan-stats", "--data", str(small_binary), "--batch-size", "64", "--cache-rows", "600",
                     "--lookahead", "1000", "--policy", policy, "--iterations", "40"]) == 0
        results[policy] = json.loads(capsys.readouterr().out)
    for stats in results.values():
        assert stats["iterations"] == 40 and stats["lookups"] == 40 * 64 * 26
        assert stats["peak_cache_rows"] <= 600
        assert stats["rows_written_back"] == stats["rows_fetched"]
    assert results["lookahead"]["rows_fetched"] == results["belady"]["rows_fetched"]
    assert results["belady"]["rows_fetched"] <= results["lru"]["rows_fetched"] < results["none"]["rows_fetched"]
    # the batches numbered in a process of their own: the same plan, and both processes' memory reported
    assert main(["plan-stats", "--data", str(small_binary), "--batch-size", "64", "--cache-rows", "600",
                 "--lookahead", "1000", "--iterations", "40", "--planner-processes", "2"]) == 0
    ahead = json.loads(capsys.readouterr().out)
    assert ahead["planner_processes"] == 2 and results["lookahead"]["planner_processes"] == 1
    for field in ("rows_fetched", "rows_written_back", "peak_cache_rows", "lookups"):
        assert ahead[field] == results["lookahead"][field], field
    assert ahead["peak_rss_bytes"]["numbering"] > 0 and "numbering" not in results["lookahead"]["peak_rss_bytes"]
    assert 0 < ahead["first_step_s"] < ahead["plan_seconds"] and ahead["ids_per_s_after_first_step"] > 0
