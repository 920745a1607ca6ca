"""The summary table of scripts/gpu_check.sh, read from the logs it left in one folder.

    python scripts/gpu_summary.py artifacts/gpu_check

Exit status 0 when the build, the gpu tests (if they ran) and fp32 greedy equality all passed.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of a log (progress bars and other text are skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            start = line.find('{"')  # progress bars (stderr, same log) may precede it on the line
            if start < 0:
                continue
            try:
                rows.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                continue
    return rows


def step_rows(log: Path) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
    status: dict[str, int] = {}
    rows = []
    for line in (log / "status.tsv").read_text().splitlines() if (log / "status.tsv").is_file() else []:
        name, rc, seconds = line.split("\t")
        status[name] = int(rc)
        verdict = "ok" if rc == "0" else ("TIMEOUT" if rc in ("124", "137") else f"FAILED (exit {rc})")
        rows.append((f"step {name}", verdict, f"{seconds} s, log {name}.log"))
    return rows, status


def test_rows(log: Path) -> list[tuple[str, str, str]]:
    xml = log / "gpu_tests.xml"
    if not xml.is_file():
        return []
    suite = ElementTree.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [case.get("name", "?") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    verdict = "ok" if failures + errors == 0 and total > skipped else "FAILED"
    detail = f"{total - failures - errors - skipped} passed, {failures + errors} failed, {skipped} skipped"
    return [("gpu-marked tests", verdict, detail + (f"; first failures: {', '.join(failed[:3])}" if failed else ""))]


def kernel_rows(log: Path) -> list[tuple[str, str, str]]:
    rows = []
    for r in json_lines(log / "kernel_bench.log"):
        if r.get("bench") == "paged_attention_decode" and r["impl"] == "kernel":
            share = f", {r['hbm_pct']}% of HBM" if "hbm_pct" in r else ""
            rows.append((f"decode attention {r['dtype']} b={r['batch']} ctx={r['context']} h={r['head_size']}",
                         f"{r['ms']} ms", f"{r['gbps']} GB/s K/V{share}"))
        elif r.get("bench") == "paged_attention_summary":
            rows.append(("  vs reference / vs SDPA (contiguous)", f"{r['speedup_vs_reference']}x",
                         f"SDPA/kernel {r['kernel_vs_sdpa']}x, paging overhead {r['paging_overhead_pct']}%"))
        elif r.get("bench") == "paged_prefill_attention" and r["impl"] == "kernel":
            rows.append((f"prefill attention {r['name']} {r['num_seqs']}x{r['q_len']} after {r['cached']}",
                         f"{r['ms']} ms", f"{r['gflops']} GFLOP/s"))
        elif r.get("bench") == "paged_prefill_summary":
            rows.append(("  vs per-sequence SDPA loop / reference", f"{r['speedup_vs_sdpa_loop']}x",
                         f"reference/kernel {r.get('speedup_vs_reference', '-')}x"))
        elif r.get("bench") == "fused" and r["impl"] == "kernel":
            share = f", {r['hbm_pct']}% of HBM" if "hbm_pct" in r else ""
            rows.append((f"fused {r['op']} {r['rows']} rows {r['dtype']}", f"{r['us']} us", f"{r['gbps']} GB/s{share}"))
        elif r.get("bench") == "fused_summary":
            rows.append(("  vs unfused torch", f"{r['speedup_vs_unfused']}x", ""))
    return rows


def greedy_rows(log: Path) -> tuple[list[tuple[str, str, str]], bool]:
    rows, fp32_ok = [], False
    for name in ("greedy_fp32", "greedy_bf16"):
        for r in json_lines(log / f"{name}.log"):
            same = f"{r['identical']}/{r['sequences']} identical"
            detail = f"mean common prefix {r['mean_common_prefix']}, min {r['min_common_prefix']}"
            if r["dtype"] == "float32":
                fp32_ok = r["identical"] == r["sequences"]
                verdict = "ok" if fp32_ok else "FAILED"
            else:
                ours, hf = r["logit_err_vs_fp32_ours"], r["logit_err_vs_fp32_hf"]
                verdict = "ok" if ours <= 1.5 * hf else "WORSE THAN HF"
                detail += f"; |logit - fp32| ours {ours} vs HF {hf}"
            rows.append((f"greedy == HF ({r['device']}, {r['dtype']}, {r['model']})", f"{verdict}: {same}", detail))
    return rows, fp32_ok


def engine_rows(log: Path) -> list[tuple[str, str, str]]:
    rows = []
    for r in json_lines(log / "engine_bench.log"):
        if "system" in r:
            extra = f", step overhead {r['step_overhead_share']}" if "step_overhead_share" in r else ""
            rows.append((f"engine bench {r['system']}", f"{r['tokens_per_s']} tok/s", f"{r['seconds']} s{extra}"))
        elif "ratio_vs_best_hf" in r:
            rows.append(("engine bench vs best HF", f"{r['ratio_vs_best_hf']}x", f"goal {r['goal']}x"))
    return rows


def main() -> int:
    log = Path(sys.argv[1] if len(sys.argv) > 1 else "artifacts/gpu_check")
    steps, status = step_rows(log)
    tests = test_rows(log)
    greedy, fp32_ok = greedy_rows(log)
    table = steps + tests + kernel_rows(log) + greedy + engine_rows(log)
    width = max((len(name) for name, _, _ in table), default=10)
    print(f"\n{'check':<{width}}  {'result':<28}  detail")
    print(f"{'-' * width}  {'-' * 28}  {'-' * 40}")
    for name, result, detail in table:
        print(f"{name:<{width}}  {result:<28}  {detail}")
    passed = status.get("build") == 0 and fp32_ok and all(v == "ok" for _, v, _ in tests)
    print(f"\noverall: {'PASS' if passed else 'FAIL'} (build, gpu tests, fp32 greedy == HF)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
