"""Markdown tables (and a plot) of a device run's results: gpu_check.py run's gpu_check.json and, where the first
call measured them, speed's gpu_speed.json.

    python benchmarks/gpu_report.py gpu_check.json [gpu_speed.json] [--plot decode.png] > tables.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CHECKS = ("teacher_forced", "greedy", "snapkv", "scorers")


def check_table(results: dict) -> list[str]:
    lines = ["| variant | top-1 vs float32 reference | greedy (prompts agreeing) | SnapKV keep sets, decode after "
             "| scorers' keep sets (lowest) | passed |", "|---|---|---|---|---|---|"]
    for variant, row in results["variants"].items():
        def cell(name, text):
            v = row.get(name, {})
            return v["error"] if "error" in v else text(v)
        scorers = row.get("scorers", {})
        lowest = min((r["overlap"], k) for k, r in scorers.items() if isinstance(r, dict)) if "error" not in scorers \
            else None
        lines.append("| " + " | ".join([
            variant,
            cell("teacher_forced", lambda v: f"{v['top1_agreement']:.4f} (bar {v['bar']})"),
            cell("greedy", lambda v: f"{sum(r['agrees'] for r in v['prompts'])}/{len(v['prompts'])}"),
            cell("snapkv", lambda v: f"{v['overlap']:.4f} (bar {v['bar']}), "
                                     f"{'agrees' if v['decode_agrees'] else 'DIFFERS'}"),
            cell("scorers", lambda v: f"{lowest[0]:.3f} {lowest[1]} (bar {v.get('bar', 0.98)})"),
            "yes" if all(row.get(c, {}).get("passed") for c in CHECKS) else "**no**"]) + " |")
    return lines


def suite_rows(model: str, weights: str, speed: dict) -> list[str]:
    lines = []
    for build in ("plain", "graph"):
        for r in speed.get(build, []) if isinstance(speed.get(build), list) else []:
            if "prefill_tok_s" not in r:
                lines.append(f"| {model} | {weights} | {build} | {r['prompt_tokens']} | {r['snapkv_budget'] or 'full'} "
                             f"| {r.get('error') or r.get('skipped')} | | | |")
                continue
            lines.append(f"| {model} | {weights} | {build} | {r['prompt_tokens']} | {r['snapkv_budget'] or 'full'} | "
                         f"{r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:,.0f} | {r['decode_floor_tok_s']:,.0f} | "
                         f"{100 * r['floor_fraction']:.1f}% |")
    return lines


def speed_table(results: dict, extra: dict | None) -> list[str]:
    lines = ["| model | weights | build | prompt | KV kept | prefill tok/s | decode tok/s | decode floor tok/s "
             "| of floor |", "|---|---|---|---|---|---|---|---|---|"]
    lines += suite_rows(results["model"], "real", results.get("speed", {}))
    models = (extra or results).get("speed_models", {})
    for name, speed in models.items():
        if isinstance(speed, dict) and name != "weights":
            lines += suite_rows(name, "random", speed)
    return lines


def profile_lines(title: str, profiles) -> list[str]:
    lines = []
    for p in profiles if isinstance(profiles, list) else []:
        lines += [f"\n{title}: {p['function']} after {p['tokens']} tokens, every call timed with the GPU synchronised "
                  f"around it: {p['kernel_calls']} kernel calls {p['kernel_ms']:.2f} ms, {p['builtin_calls']} VM "
                  f"builtin calls {p['builtin_ms']:.2f} ms\n", "| kernel | ms | calls |", "|---|---|---|"]
        lines += [f"| {name} | {ms:.3f} | {n} |" for name, ms, n in p["top"][:10]]
    return lines


def batch_table(results: dict) -> list[str]:
    rows = results.get("speed", {}).get("decode_batch", [])
    lines = ["| B | step ms | aggregate tok/s |", "|---|---|---|"]
    return lines + [f"| {r['batch']} | {r['step_ms']:.2f} | {r['aggregate_tok_s']:,.0f} |" for r in rows
                    if "step_ms" in r]


def plot(results: dict, extra: dict | None, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {results["model"]: results.get("speed", {})}
    series.update({k: v for k, v in (extra or results).get("speed_models", {}).items() if k != "weights"})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.12
    cells = [(512, 0), (4096, 0), (4096, 1024)]
    for i, (model, speed) in enumerate(series.items()):
        for j, build in enumerate(("plain", "graph")):
            rows = {(r["prompt_tokens"], r["snapkv_budget"]): r for r in speed.get(build, []) if "decode_tok_s" in r}
            xs = [c + (2 * i + j - 2.5) * width for c in range(len(cells))]
            ax.bar(xs, [rows.get(cell, {}).get("decode_tok_s", 0) for cell in cells], width, label=f"{model} {build}")
    labels = [f"{p} tokens, {'full' if b == 0 else f'SnapKV {b}'}" for p, b in cells]
    ax.set_xticks(range(len(cells)), labels)
    ax.axhline(1000, color="k", ls="--", lw=1)
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title("sharpi on an H200: decode after the prompt (dashed: the issue's 1000 tok/s)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check")
    p.add_argument("speed", nargs="?")
    p.add_argument("--plot")
    args = p.parse_args()
    results = json.loads(Path(args.check).read_text())
    extra = json.loads(Path(args.speed).read_text()) if args.speed else None
    m = results.get("machine", {})
    print(f"Machine: {m.get('gpu')}, driver {m.get('driver')}, {m.get('memory_total_mib')} MiB, {m.get('cpus')} CPUs; "
          f"Python {results['python']}.\n")
    print("\n".join(check_table(results)))
    speed, batch = speed_table(results, extra), batch_table(results)
    if len(speed) > 2:              # a `--vulkan` run, or one cut short, has the checks' speed column alone
        print()
        print("\n".join(speed))
    print("\n".join(profile_lines(results["model"], results.get("speed", {}).get("profile"))))
    for name, models in (extra or results).get("speed_models", {}).items():
        if name != "weights":
            print("\n".join(profile_lines(f"{name} (random weights)", models.get("profile"))))
    if len(batch) > 2:
        print("\ndecode_batch (SmolLM2, plain build, 128-token prompts):\n")
        print("\n".join(batch))
    if "torch_roofline" in results:
        print(f"\nPyTorch on the same GPU: {json.dumps(results['torch_roofline'])}")
    if args.plot:
        plot(results, extra, Path(args.plot))


if __name__ == "__main__":
    main()
