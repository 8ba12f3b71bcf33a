"""``testkit/pyspy.py``: py-spy's raw stacks summarised (self, inclusive and by area) and written as the two
Markdown tables a bench page shows, without py-spy itself."""

from __future__ import annotations

from testkit import pyspy

RAW = "\n".join([
    'process 7:"python -m proxy";thread (0x1);run (/usr/lib/python3.11/asyncio/runners.py:118);'
    "handle (/x/site-packages/aiohttp/web_protocol.py:4);forward (proxy/serve/relay.py:9) 6",
    "run (/usr/lib/python3.11/asyncio/runners.py:118);walk (proxy/payload/locate.py:3);"
    "walk (proxy/payload/locate.py:5) 3",
    "run (/usr/lib/python3.11/asyncio/runners.py:118);select (/x/lib/python3.11/selectors.py:468) 1",
    "not a stack line",
])


def test_raw_stacks_are_summarised_by_self_inclusive_time_and_area() -> None:
    summary = pyspy.summarise_stacks(RAW, expected=20)
    assert (summary["samples"], summary["busy_share"]) == (10, 0.5)
    assert [(row["function"], row["percent"]) for row in summary["self"]] == [
        ("forward (proxy/serve/relay.py)", 60.0), ("walk (proxy/payload/locate.py)", 30.0),
        ("select (selectors.py)", 10.0)]
    inclusive = {row["function"]: row["samples"] for row in summary["inclusive"]}
    assert inclusive["run (asyncio/runners.py)"] == 10  # every sample once, thread and process frames left out
    assert inclusive["walk (proxy/payload/locate.py)"] == 3  # a recursion counts once per sample
    assert summary["areas"][0] == {"function": "mmgate forward (proxy/serve/relay.py)", "samples": 6, "percent": 60.0}


def test_the_tables_leave_the_frames_every_sample_has_out_of_the_inclusive_one() -> None:
    lines = pyspy.tables(pyspy.summarise_stacks(RAW, expected=20), self_rows=1)
    assert lines[:3] == ["| self time: function (file) | % |", "|---|---:|",
                         "| `forward (proxy/serve/relay.py)` | 60.0 |"]
    inclusive = lines[lines.index("") + 3:]
    assert inclusive[0] == "| `handle (aiohttp/web_protocol.py)` | 60.0 |"
    assert not [line for line in inclusive if "runners.py" in line]
