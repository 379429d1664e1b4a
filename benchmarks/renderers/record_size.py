"""Record size (benchmarks/record_size.py): a job's state record as JSON, compressed and chunked,
and its write and read-back on SQLite and etcd."""

from __future__ import annotations

from typing import Any

from render import Context, Section, md_table

TITLE = "Record size: one job's state record"


def _store(row: dict[str, Any], store: str) -> str:
    timed = row.get(store)
    return f"{timed['write_s']:.2f} s / {timed['load_s']:.2f} s" if timed else "-"


def section(doc: dict[str, Any], ctx: Context) -> Section:
    rows: list[dict[str, Any]] = doc["results"]
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
