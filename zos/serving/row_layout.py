"""The engine's request-row layout between decode steps: which row each running request holds.

Rows keep their index while they run (a row's metadata then carries over on the device), holes
left by finished requests are filled by new ones, and the remaining holes are closed from the
end, as vLLM's ``InputBatch.condense`` does, so the N running requests always hold rows
0..N-1.
"""
from __future__ import annotations


def place_rows(rows: list, fresh: list) -> list[int]:
    """Stable row layout, in place: new requests fill holes (lowest first), remaining holes are
    closed by moving the LAST rows into them (vLLM's InputBatch.condense), then the rest of the
    new requests are appended. Rows that neither finished nor moved keep their index.

    Returns the rows written (a new or moved request now there), ascending."""
    holes, i = [], -1
    for _ in range(rows.count(None)):  # C-speed scans: nothing to do in a steady step
        i = rows.index(None, i + 1)
        holes.append(i)
    written = []
    for req in fresh:
        if holes:
            written.append(holes.pop(0))
            rows[written[-1]] = req
        else:
            written.append(len(rows))
            rows.append(req)
    for h in holes:  # ascending; left only when every new request found a hole
        while rows and rows[-1] is None:
            rows.pop()
        if h < len(rows):
            rows[h] = rows.pop()
            written.append(h)
    while rows and rows[-1] is None:
        rows.pop()
    return sorted(written)
