"""Rendezvous (benchmarks/rendezvous.py): world formation against TCPStore, c10d and etcd-v2."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, cast

from render import (
    Context,
    Section,
    machine_caption,
    machine_line,
    md_table,
    span,
    times,
)


class RoundSummary(TypedDict):
    """One world formation, in seconds from the common start to each member's answer."""

    formation_s: float
    member_p50_s: float
    member_min_s: float
    max_over_p50: float | None
    client_cpu_s: float
    server_cpu_s: float
    #: sarcomm only: the coordinator's first Join and formed world, after the start.
    server_first_join_s: float | None
    server_formed_s: float | None


class OutcomeRow(TypedDict):
    """One method at one size: its status, its rounds and failures, and (where a round formed a
    world) the median round's figures."""

    method: str
    size: int
    status: str  # ok, partial (some rounds formed), timeout, error, skipped
    ok_rounds: int
    failed_rounds: int
    failures: list[str]
    message: str
    rounds: list[RoundSummary]
    formation_s: NotRequired[float]
    member_p50_s: NotRequired[float]
    member_min_s: NotRequired[float]
    max_over_p50: NotRequired[float | None]
    client_cpu_s: NotRequired[float]
    server_cpu_s: NotRequired[float]
    server_first_join_s: NotRequired[float | None]
    server_formed_s: NotRequired[float | None]


def section(doc: dict[str, Any], ctx: Context) -> Section:
    results = cast(list[OutcomeRow], doc["results"])
    by: dict[tuple[str, int], OutcomeRow] = {(r["method"], r["size"]): r for r in results}
    sizes = sorted({r["size"] for r in results})

    def status(method: str, size: int) -> str | None:
        r = by.get((method, size))
        return None if r is None else r["status"]

    methods = [
        m for m in ("sarcomm", "tcpstore", "c10d", "sarcomm-etcd", "etcd-v2") if any(k[0] == m for k in by)
    ]
    deadline = float(doc.get("settings", {}).get("c10d_deadline") or 60)
    etcd_deadline = float(doc.get("settings", {}).get("etcd_v2_deadline") or 60)

    def formed(method: str, size: int) -> float | None:
        r = by.get((method, size))
        if r is None or r["status"] not in ("ok", "partial"):
            return None
        return r.get("formation_s")

    def cell(method: str, size: int) -> str:
        r = by.get((method, size))
        t = formed(method, size)
        if t is not None:
            return f"{t:.3f}"
        if r is None:
            return "-"
        slow = {"c10d": deadline, "etcd-v2": etcd_deadline}
        return {"timeout": f"DNF in {slow[method]:g}" if method in slow else "timeout"}.get(
            r["status"], r["status"]
        )

    rows = []
    for size in sizes:
        ours, floor, c10d = formed("sarcomm", size), formed("tcpstore", size), formed("c10d", size)
        spread = by[("sarcomm", size)].get("max_over_p50") if ("sarcomm", size) in by else None
        rows.append(
            (
                size,
                cell("sarcomm", size),
                cell("tcpstore", size),
                cell("c10d", size),
                times(ours, floor, "faster", "slower") if ours and floor else "-",
                times(ours, c10d, "faster", "slower") if ours and c10d else "-",
                f"{spread:.2f}" if spread else "-",
            )
        )
    body = md_table(
        [
            "N",
            "sarcomm s",
            "TCPStore s",
            "c10d s",
            "sarcomm against TCPStore",
            "sarcomm against c10d",
            "sarcomm max/p50",
        ],
        rows,
    )
    body += (
        "\n\nWorld-formation time: a common start to the last member's answer, median round. TCPStore is "
        "the floor (a bare barrier with no membership, ranks or health); c10d is torch elastic's "
        "rendezvous (`torchrun --rdzv-backend c10d`). max/p50: slowest member over the median member."
    )
    headline = []
    if {"sarcomm-etcd", "etcd-v2"} & set(methods):
        etcd_rows = []
        for size in sizes:
            ours, on_etcd, torch_etcd = (
                formed("sarcomm", size),
                formed("sarcomm-etcd", size),
                formed("etcd-v2", size),
            )
            etcd_rows.append(
                (
                    size,
                    cell("sarcomm", size),
                    cell("sarcomm-etcd", size),
                    cell("etcd-v2", size),
                    times(on_etcd, ours, "faster", "slower") if ours and on_etcd else "-",
                    times(on_etcd, torch_etcd, "faster", "slower") if on_etcd and torch_etcd else "-",
                )
            )
        body += "\n\n" + md_table(
            [
                "N",
                "sarcomm (SQLite) s",
                "sarcomm-etcd s",
                "etcd-v2 s",
                "sarcomm-etcd against SQLite",
                "sarcomm-etcd against etcd-v2",
            ],
            etcd_rows,
        )
        body += (
            "\n\nsarcomm-etcd: the coordinator keeps its state in etcd (`--store etcd://`, one etcd member "
            "on loopback, leading alone); etcd-v2: torch elastic's rendezvous over its `etcd-v2` backend "
            f"(python-etcd) on the same etcd with `--enable-v2`, one round, deadline {etcd_deadline:g} s."
        )
    both = [s for s in sizes if formed("sarcomm", s) and formed("tcpstore", s)]
    if both:
        top = both[-1]
        ours = formed("sarcomm", top) or 0.0
        slower = [(formed("sarcomm", s) or 0) / (formed("tcpstore", s) or 1) for s in both]
        over_floor = span(slower, lambda r: times(r, 1.0, "faster", "slower"))
        headline.append(
            f"sarcomm forms a {top}-member world in **{ours:.2f} s**, "
            f"**{times(ours, formed('tcpstore', top) or 0.0, 'faster', 'slower')}** than a bare TCPStore "
            f"barrier (the floor; {over_floor} over all sizes)"
        )
    c10d_ok = [s for s in sizes if formed("c10d", s) and formed("sarcomm", s)]
    if c10d_ok:
        worst = [s for s in sizes if status("c10d", s) not in ("ok", "partial", None)]
        line = ", ".join(
            f"{times(formed('sarcomm', s) or 0.0, formed('c10d', s) or 0.0, 'faster', 'slower')} at N={s}"
            for s in c10d_ok
        )
        headline.append(
            f"against c10d, sarcomm forms the world {line}"
            + (f"; c10d did not finish N={worst[0]} within {deadline:g} s" if worst else "")
        )
    pairs = [s for s in sizes if formed("sarcomm-etcd", s) and formed("etcd-v2", s)]
    if pairs:
        dnf = [s for s in sizes if status("etcd-v2", s) == "timeout"]
        headline.append(
            "on etcd, against torch elastic's etcd-v2 rendezvous, sarcomm forms the world "
            + ", ".join(
                f"{times(formed('sarcomm-etcd', s) or 0.0, formed('etcd-v2', s) or 0.0, 'faster', 'slower')} "
                f"at N={s}"
                for s in pairs
            )
            + (f"; etcd-v2 did not finish N={dnf[0]} within {etcd_deadline:g} s" if dnf else "")
        )
    if doc.get("verdict"):
        headline.append(str(doc["verdict"]))
    plot = ""
    if ctx.plt is not None:
        fig, (ax,) = ctx.figure()
        styles = {
            "sarcomm": ("o-", "sarcomm"),
            "tcpstore": ("s--", "TCPStore (floor)"),
            "c10d": ("^-", "c10d"),
            "sarcomm-etcd": ("o:", "sarcomm (etcd store)"),
            "etcd-v2": ("v-", "torch etcd-v2"),
        }
        for method in methods:
            points = [(s, formed(method, s)) for s in sizes if formed(method, s)]
            if points:
                ax.plot(*zip(*points, strict=True), styles[method][0], label=styles[method][1])
        failed = [s for s in sizes if status("c10d", s) == "timeout"]
        if failed:
            ax.plot(
                failed,
                [deadline] * len(failed),
                "rx",
                markersize=10,
                label=f"c10d: not done in {deadline:g} s",
            )
        ax.set(xscale="log", yscale="log", xlabel="members N", ylabel="world formation (s)")
        ax.set_title("Rendezvous: time to form a world of N members")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
        machine_caption(ax, machine_line(doc))
        plot = ctx.save(fig, "rendezvous")
    return Section.of(doc, "rendezvous", "Rendezvous", headline, body, plot)
