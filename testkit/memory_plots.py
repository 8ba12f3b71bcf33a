"""The memory charts beside the memory benches' pages: ``soak`` (bench/soak.py: mmgate's RSS over a soak, idle
checkpoints against the goal's band) and ``peak_rss`` (bench/gate_sweep.py's peak_rss: predicted and measured
peaks per cell). matplotlib (the bench extra) is imported only when a chart is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from testkit.allocators import env_text

MIB = 1 << 20


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def soak(runs: list[dict[str, Any]], tolerance_pct: float, path: Path) -> None:
    """Left: RSS vs requests (thin: under load; thick: idle checkpoints; the goal's band); right: RSS vs time."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    reference = next((r for r in runs if r["variant"] == "default"), runs[0] if runs else None)
    if reference and (ref := reference["criterion"]["reference_rss_mib"]):
        ax1.axhspan(ref * (1 - tolerance_pct / 100), ref * (1 + tolerance_pct / 100), color="green", alpha=0.12,
                    label=f"±{tolerance_pct:g} % of {reference['variant']}'s idle RSS at "
                          f"{reference['criterion']['reference_requests']} requests")
    for run in runs:
        loaded = [s for s in run["samples"] if s[3]]
        line, = ax1.plot([s[1] for s in loaded], [s[2] / MIB for s in loaded], lw=0.6, alpha=0.45)
        cps, color = run["checkpoints"], line.get_color()
        label = f"{run['variant']}: {env_text(run['env'], '', '(defaults)')}, trim {'on' if run['trim'] else 'off'}"
        ax1.plot([c["requests_done"] for c in cps], [c["rss_idle_mib"] for c in cps], "o-", lw=2.4, ms=5, color=color,
                 label=label)
        ax2.plot([s[0] for s in run["samples"]], [s[2] / MIB for s in run["samples"]], lw=0.6, color=color,
                 label=run["variant"])
        ax2.plot([c["t_s"] + c["pause_s"] for c in cps], [c["rss_idle_mib"] for c in cps], "o", ms=4, color=color)
    if runs:
        ax1.axvline(runs[0]["criterion"]["reference_requests"] or 0, color="grey", ls="--", lw=0.8,
                    label="end of warm-up (10 %)")
    ax1.set_xlabel("requests finished")
    ax2.set_xlabel("seconds since mmgate started (dips: idle checkpoints)")
    for ax in (ax1, ax2):
        ax.set_ylabel("mmgate VmRSS (MiB)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax1.legend(fontsize=7, loc="upper left", framealpha=0.9)
    ax1.set_title("RSS vs requests: thin = under load (0.5 s samples), thick = idle RSS at checkpoints", fontsize=10)
    ax2.set_title("RSS vs time", fontsize=10)
    fig.suptitle(f"mmgate soak, {max((r['requests'] for r in runs), default=0)} mixed multimodal requests, "
                 f"{runs[0]['clients'] if runs else 0} clients. Goal: after warm-up, idle RSS within "
                 f"{tolerance_pct:g} % of the first post-warm-up checkpoint", fontsize=11)
    ax1.set_ylim(top=ax1.get_ylim()[1] * 1.3)  # room for the legend
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def peak_rss(data: dict[str, Any], labels: list[str], path: Path) -> None:
    """Bars: predicted and measured proxy peak, and backend peak, per cell (``labels``: one per row)."""
    plt = _pyplot()
    rows = data["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(12, 5))
    series = (("proxy predicted (bodies = min(clients, K + Q))", "predicted_mib", "#c6dbef"),
              ("proxy predicted (every body read counted)", "predicted_reading_mib", "#9ecae1"),
              ("proxy measured (VmHWM)", "proxy_hwm_mib", "#3182bd"),
              ("backend measured (VmHWM)", "backend_hwm_mib", "#fd8d3c"))
    width = 0.2
    for k, (name, key, color) in enumerate(series):
        bars = ax.bar([i + (k - 1.5) * width for i in x], [r[key] for r in rows], width, label=name, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.axhline(data["model"]["baseline_cold_mib"], color="grey", lw=0.8, ls="--", label="proxy baseline (idle)")
    ax.set_xticks(list(x), [label.replace(", ", ",\n").replace(" + ", "\n+ ") for label in labels], fontsize=8)
    ax.set_ylabel("peak RSS, MiB")
    ax.set_title(f"{data['meta']['clients']} clients × one 12 MP photo at once: peak RSS")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
