"""Record size (benchmarks/record_size.py): a job's state record as JSON, compressed and chunked,
and its write and read-back on SQLite and etcd."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, cast

from render import Context, Section, md_table

TITLE = "Record size: one job's state record"


class RoundTrip(TypedDict):
    """The record written to a store and read back, in seconds."""

    write_s: float
    load_s: float


class SizeRow(TypedDict):
    """One job size and Join shape: its record's sizes, and its round trips where stores ran."""

    members: int
    per_join: int
    json_bytes: int
    zlib_bytes: int
    head_bytes: int
    chunks: int
    largest_chunk_bytes: int
    chunked_bytes: int
    encode_s: float
    fits_one_request: bool
    sqlite: NotRequired[RoundTrip]
    etcd: NotRequired[RoundTrip]


def _store(row: SizeRow, store: Literal["sqlite", "etcd"]) -> str:
    timed = row.get(store)
    return f"{timed['write_s']:.2f} s / {timed['load_s']:.2f} s" if timed else "-"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows = cast(list[SizeRow], doc["results"])
    top = rows[-1]
    headline = [
        f"{top['members']} members ({top['per_join']} per Join): {top['json_bytes'] / 1e6:.1f} MB of JSON, "
        f"{top['zlib_bytes'] / 1e6:.1f} MB compressed, written as {top['chunks']} chunks of at most "
        f"{top['largest_chunk_bytes']:,} bytes"
    ]
    fits = [r["members"] for r in rows if r["fits_one_request"]]
    if fits:
        headline.append(f"the whole record fits one request up to {max(fits)} members")
    table = md_table(
        [
            "members",
            "per Join",
            "JSON",
            "zlib, whole",
            "fits one request",
            "chunks",
            "largest chunk",
            "chunks, total",
            "encode (loop)",
            "SQLite write / load",
            "etcd write / load",
        ],
        [
            (
                r["members"],
                r["per_join"],
                f"{r['json_bytes']:,}",
                f"{r['zlib_bytes']:,}",
                "yes" if r["fits_one_request"] else "no",
                r["chunks"],
                f"{r['largest_chunk_bytes']:,}",
                f"{r['chunked_bytes']:,}",
                f"{r['encode_s']:.2f} s",
                _store(r, "sqlite"),
                _store(r, "etcd"),
            )
            for r in rows
        ],
        "rrrrcrrrrcc",
    )
    limit = doc.get("max_chunk_bytes")
    body = table + "\n\nSizes in bytes." + (f" A chunk may take at most {limit:,} bytes." if limit else "")
    return Section.of(doc, "record_size", TITLE, headline, body)
