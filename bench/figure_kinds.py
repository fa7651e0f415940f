"""How each kind of figure set is drawn: a figure set's `kind` picks its
drawer in DRAWERS, which draws the set on an empty matplotlib figure and returns
the line under it that says how to read it (bench.plots adds the title, that
line, the date and the CPU, and writes the PNG)."""
from __future__ import annotations

import statistics
from collections.abc import Callable

from matplotlib.figure import Figure

OURS, ENGINE, PEER, PEER_2, GREY = "#3949ab", "#9fa8da", "#ef6c00", "#ffb74d", "#757575"


def records(figure_set: dict) -> list[dict]:
    """The set's rows as dicts keyed by its columns."""
    return [dict(zip(figure_set["columns"], row)) for row in figure_set["rows"]]



def _value_axis(ax, ylabel: str, top: float, log: bool, log_headroom: float) -> None:
    """A panel's value axis up to `top` with room for the labels above the
    bars: log scale with `log_headroom` times top, else linear from 0."""
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=top * log_headroom)
    else:
        ax.set_ylim(0, top * 1.2)
    ax.grid(axis="y", alpha=0.3)

def _label(ax, x: float, y: float, text: str, **kw) -> None:
    ax.annotate(text, (x, y), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                fontsize=kw.pop("fontsize", 9), **kw)


def _times(ratio: float) -> str:
    """A ratio as the rounds report it: three significant digits, 1.00 not 1."""
    text = f"{ratio:.3g}"
    return "×" + (f"{ratio:.2f}" if "." not in text and ratio < 100 else text)


def _levels(streams: int) -> str:
    return f"{streams} stream" + ("s" if streams > 1 else "")


# --- against a peer server: tokens/s, TTFT and ITL at each level -------------------------------

def draw_peers(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    peer, ours, engine = (fs["servers"].get(k) for k in ("peer", "ours", "engine"))  # engine: optional
    sides = [(server, color) for server, color in ((peer, PEER), (ours, OURS), (engine, ENGINE)) if server]
    rounds = list(dict.fromkeys(r["round"] for r in rows))
    levels = sorted({r["streams"] for r in rows})
    by = {(r["round"], r["server"], r["streams"]): r for r in rows}

    def values(server: str, level: int, key: str) -> list[float]:
        return [by[rd, server, level][key] for rd in rounds if (rd, server, level) in by]

    def ratio(num: str, den: str, level: int, key: str) -> float:
        return statistics.median(by[rd, num, level][key] / by[rd, den, level][key] for rd in rounds)

    panels = (("tok_s", None, "output tokens/s", False), ("ttft_p50_s", "ttft_p90_s", "TTFT p50 (s, log)", True),
              ("itl_p50_ms", "itl_p90_ms", "ITL p50 (ms, log)", True))
    width = 0.27
    for ax, (key, p90_key, ylabel, log) in zip(fig.subplots(1, 3), panels):
        top = 0.0
        for i, (server, color) in enumerate(sides):
            xs = [j + (i - (len(sides) - 1) / 2) * width for j in range(len(levels))]
            spread = [values(server, lv, key) for lv in levels]
            medians = [statistics.median(v) for v in spread]
            err = [[m - min(v) for m, v in zip(medians, spread)], [max(v) - m for m, v in zip(medians, spread)]]
            ax.bar(xs, medians, width, color=color, label=server, yerr=err if len(rounds) > 1 else None,
                   capsize=3, error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
            if p90_key:
                p90 = [statistics.median(values(server, lv, p90_key)) for lv in levels]
                ax.scatter(xs, p90, marker="_", s=160, color="black", zorder=3, label="p90" if i == 0 else None)
                top = max(top, *p90)
            top = max(top, *(max(v) for v in spread))
            if server == ours:
                for x, lv, m in zip(xs, levels, medians):
                    bar_top = max(m, *(values(ours, lv, p90_key) if p90_key else [m]))
                    _label(ax, x, bar_top, _times(ratio(ours, peer, lv, key)), fontweight="bold", color=OURS)
        if key == "tok_s" and engine:
            last = levels[-1]
            _label(ax, len(levels) - 1 + width, max(values(engine, last, key)),
                   f"chain ÷ engine\n{_times(ratio(ours, engine, last, key))}", color=GREY, fontsize=8)
        ax.set_xticks(range(len(levels)), [_levels(lv) for lv in levels])
        _value_axis(ax, ylabel, top, log, log_headroom=2.5)
    handles, labels = fig.axes[1].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == "p90")  # the servers first
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    fig.legend(handles, labels, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 0.93), frameon=False)
    whiskers = f"whiskers: range over the {len(rounds)} rounds; " if len(rounds) > 1 else "one round; "
    chain = f" (chain: {ours} ÷ {engine})" if engine else ""
    return (f"bars: medians over rounds ({', '.join(rounds)}); {whiskers}×: {ours} ÷ {peer}, median of the "
            f"per-round ratios{chain}")


# --- one stream against other servers, as a ratio to a baseline ---------------------------------

def draw_endpoints(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    endpoints = list(dict.fromkeys(r["endpoint"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    # The baseline grey, ours blue, peers orange; `ours` names more than one of ours.
    ours = fs.get("ours", endpoints[1:2])
    peers = iter((PEER, PEER_2))
    colors = [GREY if e == endpoints[0] else (OURS, ENGINE)[ours.index(e)] if e in ours else next(peers)
              for e in endpoints]
    ax_tps, ax_ttft = fig.subplots(1, 2, gridspec_kw={"width_ratios": (3, 2)})
    width = 0.8 / len(endpoints)
    for i, (endpoint, color) in enumerate(zip(endpoints, colors)):
        for j, workload in enumerate(workloads):
            row = next(r for r in rows if r["endpoint"] == endpoint and r["workload"] == workload)
            x = j + (i - (len(endpoints) - 1) / 2) * width
            ax_tps.bar(x, row["tok_s"], width, color=color, label=endpoint if j == 0 else None)
            _label(ax_tps, x, row["tok_s"], f"×{row['ratio_to_baseline']:.2f}", fontsize=8)
    ax_tps.set_xticks(range(len(workloads)), [fs.get("workload_label", "{} prompts").format(w) for w in workloads])
    ax_tps.set_ylabel(fs.get("tok_s_label", "output tokens/s, 1 stream"))
    ax_tps.set_ylim(0, max(r["tok_s"] for r in rows) * 1.2)
    ax_tps.legend(fontsize=8, loc=fs.get("legend", "upper right"))
    ax_tps.grid(axis="y", alpha=0.3)
    timed = [r for r in rows if r["ttft_p50_ms"] is not None]
    ax_ttft.barh([r["endpoint"] for r in timed], [r["ttft_p50_ms"] for r in timed],
                 color=[colors[endpoints.index(r["endpoint"])] for r in timed])
    for y, r in enumerate(timed):
        ax_ttft.annotate(f"{r['ttft_p50_ms']:.0f} ms", (r["ttft_p50_ms"], y), xytext=(3, 0),
                         textcoords="offset points", va="center", fontsize=8)
    ax_ttft.invert_yaxis()
    ax_ttft.set_xlabel(f"TTFT p50 (ms), " + fs.get("workload_label", "{} prompts").format(timed[0]["workload"]))
    ax_ttft.set_xlim(0, max(r["ttft_p50_ms"] for r in timed) * 1.25)
    ax_ttft.tick_params(axis="y", labelsize=8)
    ax_ttft.grid(axis="x", alpha=0.3)
    fast, slow = ours[0], endpoints[-1]
    versus = ", ".join(f"{workload} {_tok_s(rows, fast, workload) / _tok_s(rows, slow, workload):.1f}×"
                       for workload in workloads)
    return f"×: tokens/s ÷ {fs['baseline']}'s (median of the rounds); {fast} ÷ {slow}: {versus}"


def _tok_s(rows: list[dict], endpoint: str, workload: str) -> float:
    return next(r["tok_s"] for r in rows if r["endpoint"] == endpoint and r["workload"] == workload)


# --- a setting on against off, paired round by round --------------------------------------------

def draw_paired_ratios(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    ax = fig.subplots()
    top = max(max(r["ratios"]) for r in rows)
    for x, r in enumerate(rows):
        median = statistics.median(r["ratios"])
        ax.bar(x, median, 0.6, color=OURS if median >= 1.05 else ENGINE,
               label="median of the rounds" if x == 0 else None)
        n = len(r["ratios"])
        jitter = [x + 0.3 * (k - (n - 1) / 2) / max(1, n - 1) for k in range(n)]
        ax.scatter(jitter, r["ratios"], color="black", s=14, zorder=3, label="one round" if x == 0 else None)
        on = r["tokens_per_step_on"]
        steps = f"{on:.{2 if on < 10 else 1}f} tokens/step" + (
            f" ({r['tokens_per_step_off']:.1f} off)" if r["tokens_per_step_off"] else "")
        _label(ax, x, max(r["ratios"]), _times(median), fontweight="bold", fontsize=11)
        ax.annotate(f"{r['off_tok_s']:.0f} → {r['on_tok_s']:.0f} tok/s\n{steps}\n{r['kept']:.0%} of drafts kept",
                    (x, 0.05), ha="center", va="bottom", fontsize=8, color="white" if median >= 1.05 else "black")
    ax.axhline(1.0, color=GREY, linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), [f"{r['workload']} prompts\n{_levels(r['streams'])}" for r in rows])
    ax.set_ylabel("output tokens/s, on ÷ off in the same round")
    ax.set_ylim(0, top * 1.15)
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return "bars: median of the per-round ratios; dots: each round; dashed: no change"


# --- a kernel, two source trees side by side ----------------------------------------------------

def draw_kernel_ab(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    ax = fig.subplots()
    for threads, color in zip(sorted({r["threads"] for r in rows}, reverse=True), (OURS, PEER)):
        mine = sorted((r for r in rows if r["threads"] == threads), key=lambda r: r["rows"])
        xs = [r["rows"] for r in mine]
        ax.plot(xs, [r["before_ms"] for r in mine], "o--", color=color, alpha=0.55,
                label=f"{threads} thread{'s' if threads > 1 else ''}: {fs['peer'].split(' (')[0]}")
        ax.plot(xs, [r["now_ms"] for r in mine], "o-", color=color, linewidth=2,
                label=f"{threads} thread{'s' if threads > 1 else ''}: now")
        for r in mine:
            change = r["now_ms"] / r["before_ms"]
            if abs(change - 1) >= 0.05:
                ax.annotate(f"×{change:.2f}", (r["rows"], r["now_ms"]), xytext=(0, -14), textcoords="offset points",
                            ha="center", fontsize=8, color=color, fontweight="bold")
    ax.set_xlabel("query rows of the sequence (its decode and its draft)")
    ax.set_ylabel("ms per step (30 layers)")
    ax.set_xticks(sorted({r["rows"] for r in rows}))
    ax.set_ylim(0, max(r["before_ms"] for r in rows) * 1.1)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return "dashed: before; solid: now; ×: now ÷ before, where it moved 5 % or more"


# --- a layer against its roofline floors (bench.moe_layer) --------------------------------------

def draw_floors(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    ax = fig.subplots()
    sides = (("ours", OURS, fs["labels"]["ours"]), ("reference", PEER, fs["labels"]["reference"]))
    width = 0.27
    for i, (key, color, label) in enumerate(sides):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r[f"{key}_ms"] for r in rows], width, color=color, label=label)
        ax.scatter(xs, [r[f"{key}_p90_ms"] for r in rows], marker="_", s=160, color="black", zorder=3,
                   label="p90" if i == 0 else None)
        if key == "ours":
            for x, r in zip(xs, rows):
                _label(ax, x, r["ours_p90_ms"], f"×{r['ours_ms'] / max(r['bw_floor_ms'], r['flop_floor_ms']):.2f}",
                       fontweight="bold", color=OURS)
    floors = [max(r["bw_floor_ms"], r["flop_floor_ms"]) for r in rows]
    ax.bar([j + width for j in range(len(rows))], floors, width, color=GREY, label="the larger floor")
    for j, r in enumerate(rows):
        bound = "bandwidth" if r["bw_floor_ms"] >= r["flop_floor_ms"] else "compute"
        _label(ax, j + width, floors[j], bound, fontsize=8, color=GREY)
    ax.set_xticks(range(len(rows)), [f"{r['tokens']} token{'s' if r['tokens'] > 1 else ''}\n"
                                     f"({r['experts']} experts touched)" for r in rows])
    ax.set_ylabel("ms per layer, median over rounds (log)")
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["reference_p90_ms"] for r in rows) * 3)
    ax.legend(loc="upper left", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return (f"×: {fs['labels']['ours']} ÷ the larger floor (bytes touched over the measured read bandwidth, "
            f"or FLOPs over our own dense kernel's measured rate)")


# --- model steps of two or more sides (bench.step_ab) -------------------------------------------

def draw_step_sides(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    for ax, kind, title in zip(fig.subplots(1, 2), ("prefill", "decode"), ("prefill step", "decode step")):
        xs = range(len(rows))
        ax.bar(xs, [r[f"{kind}_ms"] for r in rows], 0.6, color=[OURS, PEER, PEER_2][:len(rows)])
        ax.scatter(xs, [r[f"{kind}_p90_ms"] for r in rows], marker="_", s=300, color="black", zorder=3, label="p90")
        for x, r in zip(xs, rows):
            _label(ax, x, r[f"{kind}_p90_ms"], f"{r[f'{kind}_ms']:g} ms  ×{r[f'{kind}_ratio']:.2f}", fontsize=9)
        ax.set_xticks(list(xs), [r["side"].replace(", ", ",\n", 1) for r in rows], fontsize=9)
        ax.set_ylabel(f"{title} (ms), median over rounds")
        ax.set_ylim(0, max(r[f"{kind}_p90_ms"] for r in rows) * 1.2)
        ax.legend(loc="upper left", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    left_out = f"; left out: {fs['left_out'].split(' (')[0]} (see the page)" if fs.get("left_out") else ""
    return f"×: ÷ {fs['peer']}, median of the per-round ratios{left_out}"


# --- A against B, round by round ----------------------------------------------------------------

def draw_ab_rounds(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    a, b = fs["labels"]["a"], fs["labels"]["b"]
    ax_tps, ax_ratio = fig.subplots(1, 2)
    xs = [r["round"] for r in rows]
    ax_tps.bar([x - 0.2 for x in xs], [r["a_tok_s"] for r in rows], 0.4, color=OURS, label=a)
    ax_tps.bar([x + 0.2 for x in xs], [r["b_tok_s"] for r in rows], 0.4, color=ENGINE, label=b)
    ax_tps.set_xticks(xs, [f"{r['round']}\n{r['first']} first" for r in rows], fontsize=8)
    ax_tps.set_ylabel("output tokens/s")
    ax_tps.set_ylim(0, max(max(r["a_tok_s"], r["b_tok_s"]) for r in rows) * 1.2)
    ax_tps.legend(loc="upper left", fontsize=9)
    ax_tps.grid(axis="y", alpha=0.3)
    ratios = [r["a_tok_s"] / r["b_tok_s"] for r in rows]
    firsts = {r["first"] for r in rows}
    for first, color in zip(sorted(firsts), (OURS, PEER)):
        mine = [(x, q) for x, q, r in zip(xs, ratios, rows) if r["first"] == first]
        ax_ratio.scatter(*zip(*mine), color=color, s=40, zorder=3, label=f"{first} ran first")
    paired = statistics.median(ratios)
    of_medians = statistics.median(r["a_tok_s"] for r in rows) / statistics.median(r["b_tok_s"] for r in rows)
    ax_ratio.axhline(paired, color="black", linewidth=1.5, label=f"median of the rounds ×{paired:.2f}")
    ax_ratio.axhline(1.0, color=GREY, linestyle="--", linewidth=1)
    ax_ratio.set_xticks(xs)
    ax_ratio.set_xlabel("round")
    ax_ratio.set_ylabel(f"tokens/s, {a} ÷ {b}")
    ax_ratio.set_ylim(min(ratios) - 0.05, max(ratios) + 0.08)
    ax_ratio.legend(loc="upper left", fontsize=9)
    ax_ratio.grid(alpha=0.3)
    return f"median tokens/s {a} ÷ {b}: ×{of_medians:.2f}; median of the per-round ratios ×{paired:.2f}"


# --- a CPU-time bound against a step's duration --------------------------------------------------

def draw_cpu_bound(fig: Figure, fs: dict) -> str:
    rows = {r["per"]: r for r in records(fs)}
    step_us = fs["step_ms"] * 1000
    per_step = {  # each part's CPU per average decode step
        rows["step"]["part"]: rows["step"]["cpu_us"],
        f"{rows['request']['part']}, {fs['sequences']}/{fs['output_len']} per step":
            rows["request"]["cpu_us"] * fs["sequences"] / fs["output_len"],
        f"{rows['scrape']['part']}, one every {fs['scrape_s']:g} s":
            rows["scrape"]["cpu_us"] * step_us / (fs["scrape_s"] * 1e6),
    }
    total = sum(per_step.values())
    bars = {**per_step, "the metrics, per step": total, f"the decode step itself ({fs['step_ms']:g} ms)": step_us}
    ax = fig.subplots()
    colors = [ENGINE] * len(per_step) + [OURS, GREY]
    ax.barh(list(bars), list(bars.values()), color=colors)
    for y, value in enumerate(bars.values()):
        ax.annotate(f"{value:,.1f} µs" if value < 1000 else f"{value:,.0f} µs", (value, y), xytext=(4, 0),
                    textcoords="offset points", va="center", fontsize=9)
    budget = fs["budget_pct"] / 100 * step_us
    ax.axvline(budget, color=PEER, linestyle="--", label=f"{fs['budget_pct']:g} % of the step: {budget:,.0f} µs")
    ax.set_xscale("log")
    ax.set_xlim(1, step_us * 12)
    ax.invert_yaxis()
    ax.set_xlabel("CPU µs per average decode step (log)")
    ax.tick_params(axis="y", labelsize=9)
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{100 * total / step_us:.2f} % of a {fs['step_ms']:g} ms step of {fs['sequences']} sequences",
                 fontsize=11)
    return "per part: CPU µs per call × calls per average step"


# --- a value over time, before and after ---------------------------------------------------------

def draw_timeline(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    ax = fig.subplots()
    xs = [r["seconds"] for r in rows]
    for key, color in (("before", PEER), ("after", OURS)):
        ys = [r[key] for r in rows]
        ax.plot(xs, ys, "o-", color=color, linewidth=2, label=key)
        _label(ax, xs[-1], ys[-1], f"{ys[-1] - ys[0]:+.1f} {fs['unit']}", fontweight="bold", color=color)
    ax.set_xlabel("seconds since the stalled clients connected")
    ax.set_ylabel(f"RSS ({fs['unit']})")
    ax.set_ylim(0, max(max(r["before"], r["after"]) for r in rows) * 1.15)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return f"before: {fs['peer']}; after: {fs['build']}"


# --- colocated against disaggregated prefill and decode (bench.disaggregation) ------------------

def draw_disaggregation(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    base, split = fs["labels"]["base"], fs["labels"]["split"]
    rounds = list(dict.fromkeys(r["round"] for r in rows))
    levels = sorted({r["streams"] for r in rows})
    by = {(r["round"], r["chain"], r["streams"]): r for r in rows}

    def values(chain: str, level: int, key: str) -> list[float]:
        return [by[rd, chain, level][key] for rd in rounds if (rd, chain, level) in by]

    def ratio(level: int, key: str) -> float:
        return statistics.median(by[rd, split, level][key] / by[rd, base, level][key] for rd in rounds)

    panels = (("streams' ITL (ms, log): p50 bars", [("itl_p50_ms", "itl_p90_ms", "")], True),
              ("long prompts' TTFT p50 (s)", [("long_ttft_p50_s", "long_ttft_p90_s", "")], False),
              ("streams' TTFT p50 (s)", [("stream_ttft_p50_s", None, "")], False),
              ("tokens/s", [("tok_s", None, "output"), ("all_tok_s", None, "all")], False))
    width = 0.38
    axes = fig.subplots(1, 4, gridspec_kw={"width_ratios": (1, 1, 1, 1.8)})
    for ax, (ylabel, keys, log) in zip(axes, panels):
        ticks, top = [], 0.0
        for k, (key, p90_key, name) in enumerate(keys):
            for j, level in enumerate(levels):
                x0 = k * len(levels) + j
                ticks.append((x0, f"{name}\n{level}" if name else str(level)))
                for i, (chain, color) in enumerate(((base, PEER), (split, OURS))):
                    x = x0 + (i - 0.5) * width
                    spread = values(chain, level, key)
                    median = statistics.median(spread)
                    ax.bar(x, median, width, color=color, label=chain if k == j == 0 else None,
                           yerr=[[median - min(spread)], [max(spread) - median]] if len(rounds) > 1 else None,
                           capsize=3, error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
                    mark = median
                    if p90_key:
                        mark = statistics.median(values(chain, level, p90_key))
                        ax.scatter([x], [mark], marker="_", s=160, color="black", zorder=3,
                                   label="p90" if k == j == i == 0 else None)
                    if chain == split:
                        _label(ax, x, max(mark, max(spread)), _times(ratio(level, key)), fontweight="bold",
                               color=OURS, fontsize=9 if len(keys) == 1 else 8)
                    if key == "itl_p50_ms":  # where a prefill's stall of the decodes shows first
                        mark = statistics.median(values(chain, level, "itl_p99_ms"))
                        ax.scatter([x], [mark], marker="x", s=40, color="black", zorder=3,
                                   label="p99" if k == j == i == 0 else None)
                        if chain == split:
                            _label(ax, x, mark * 1.15, f"p99 {_times(ratio(level, 'itl_p99_ms'))}",
                                   fontweight="bold", color=OURS, fontsize=8)
                    top = max(top, mark, max(spread))
        ax.set_xticks([t for t, _ in ticks], [name for _, name in ticks], fontsize=9)
        ax.set_xlabel("streams", fontsize=9)
        _value_axis(ax, ylabel, top, log, log_headroom=3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, bbox_to_anchor=(0.5, 0.93), frameon=False)
    t = fs["transfer"]
    return (f"bars: medians over rounds ({', '.join(map(str, rounds))}); whiskers: range; ×: {split} ÷ {base}, "
            f"median of the per-round ratios; 'all': prompt and output tokens the scheduler counted. KV transfer "
            f"({split}): {t['bytes_per_block']:,} bytes and {t['ms_per_block']:.1f} ms a block, "
            f"{t['ms_per_transfer']:.0f} ms a transfer of {t['blocks_per_transfer']:.0f} blocks (median of the runs)")


# --- one answer's time, idle and beside a busy process, per setting ------------------------------

def draw_neighbour(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    by = {(r["setting"], r["load"]): r for r in rows}
    ax = fig.subplots()
    for offset, (load, color) in zip((-0.2, 0.2), (("idle", ENGINE), ("busy", OURS))):
        xs = [i + offset for i in range(len(settings))]
        medians = [by[name, load]["median_s"] for name in settings]
        p90s = [by[name, load]["p90_s"] for name in settings]
        ax.bar(xs, medians, 0.4, color=color, label=fs["labels"][load])
        ax.errorbar(xs, medians, yerr=[[0] * len(xs), [p - m for p, m in zip(p90s, medians)]], fmt="none",
                    ecolor="black", capsize=4, linewidth=1)
        base = by[settings[0], load]["median_s"]
        for x, m in zip(xs, medians):
            _label(ax, x, m, f"{m:.2f} s\n{_times(m / base)}", fontsize=8)
    _value_axis(ax, f"seconds for {fs['max_tokens']} tokens (median; whisker: p90)",
                max(r["p90_s"] for r in rows), log=True, log_headroom=4)
    ax.set_xticks(range(len(settings)), settings)
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return f"ratios to {settings[0]} under the same load (medians of all rounds)"


# --- one scheduler's CPU per step, two trees (bench.scheduler_throughput) ------------------------

def draw_scheduler(fig: Figure, fs: dict) -> str:
    rows = records(fs)
    ax = fig.subplots()
    xs = range(len(rows))
    before = [r["before_us"] for r in rows]
    ax.bar([x - 0.2 for x in xs], [b or 0 for b in before], 0.4, color=ENGINE, label=fs["labels"]["before"])
    ax.bar([x + 0.2 for x in xs], [r["after_us"] for r in rows], 0.4, color=OURS, label=fs["labels"]["after"])
    for x, r in zip(xs, rows):
        if r["before_us"] is None:
            _label(ax, x - 0.2, fs["goal_us"], "not all\nrunning\nin 60 s", fontsize=7, color=GREY)
        else:
            _label(ax, x - 0.2, r["before_us"], f"{r['before_us']:,.0f}", fontsize=7)
        ratio = f"\n{_times(r['ratio'])}" if r["ratio"] is not None else ""
        _label(ax, x + 0.2, r["after_us"], f"{r['after_us']:,.0f}{ratio}", fontsize=7, fontweight="bold")
    ax.axhline(fs["goal_us"], color=PEER, linestyle="--", linewidth=1.5, label=fs["labels"]["goal"])
    _value_axis(ax, "scheduler CPU per step (µs, all its threads)", max(b or 0 for b in before), log=True,
                log_headroom=3)
    ax.set_ylim(bottom=min(fs["goal_us"] / 2, min(r["after_us"] for r in rows) / 1.5))
    ax.set_xticks(list(xs), [f"{r['workers']} × {r['sequences']}" for r in rows])
    ax.set_xlabel("workers × sequences each")
    ax.legend(loc="upper left", fontsize=9)
    return ("medians of the rounds; ×: after ÷ before, the median of the per-round ratios; "
            "the simulated workers and the caller share the machine's cores with the scheduler")


# A figure set's `kind` picks its drawer: it draws the set on an empty figure and
# returns the line under it that says how to read it.
DRAWERS: dict[str, Callable[[Figure, dict], str]] = {
    "peers": draw_peers, "endpoints": draw_endpoints, "paired_ratios": draw_paired_ratios,
    "kernel_ab": draw_kernel_ab, "floors": draw_floors, "step_sides": draw_step_sides, "ab_rounds": draw_ab_rounds,
    "cpu_bound": draw_cpu_bound, "timeline": draw_timeline, "disaggregation": draw_disaggregation,
    "neighbour": draw_neighbour, "scheduler": draw_scheduler,
}
