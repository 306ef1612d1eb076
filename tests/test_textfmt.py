"""The one duration format and the one table layout every command prints."""

from __future__ import annotations

import math

from marin.textfmt import format_duration, format_table


def test_durations_read_in_minutes_then_hours():
    assert [format_duration(s) for s in (0, 42, 185.9, 3599, 3600, 7620, -5)] == \
        ["0m00s", "0m42s", "3m05s", "59m59s", "1h00m", "2h07m", "0m00s"]
    assert format_duration(None) == format_duration(math.nan) == format_duration(math.inf) == "-"


def test_table_pads_columns_aligns_numbers_right_and_marks_missing_cells():
    text = format_table(("name", "steps"), [("d768", 12_122), ("d2048", None)], right=(1,))
    assert text.splitlines() == ["name   steps",
                                 "-----  -----",
                                 "d768   12122",
                                 "d2048      -"]


def test_table_inside_a_report_without_a_rule_or_a_header():
    assert format_table(("part", "bytes", ""), [("params", "1.78 GiB", ""), ("total", "1.78 GiB", "fits")],
                        right=(1,), rule=False, indent="  ").splitlines() == \
        ["  part       bytes",
         "  params  1.78 GiB",
         "  total   1.78 GiB  fits"]
    # label / value pairs: no header line, the labels padded to the longest
    assert format_table((), [("layers", 48), ("active params", "22.71B")]).splitlines() == \
        ["layers         48", "active params  22.71B"]
