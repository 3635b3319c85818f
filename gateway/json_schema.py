"""JSON Schema facts shared by the gateway's two schema compilers — `response_format` (gateway/grammar_cache.py,
through llguidance's JSON compiler) and tool parameters (gateway/tool_schema.py, in each family's call syntax) — so both generate exactly the same values for a `format`.

`format` `date`, `time` and `date-time` are the subset of RFC 3339 that Python's `datetime` and jsonschema
accept: real calendar dates (Feb 29 only in leap years), years 0001-9999, seconds 00-59 (no leap second), at most
9 fraction digits, upper-case `T`/`Z`. (llguidance's own regexes allow 2023-02-29, year 0000, second 60 and
lower-case `t`/`z`.) The regexes are unanchored (Rust `regex` syntax, which Python's `re` also reads).
"""

from __future__ import annotations

_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"

DATE_REGEX = (r"(?:" + _YEAR + r"-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
              r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))|" + _LEAP_YEAR + r"-02-29)")
"""An RFC 3339 full-date Python's `date.fromisoformat` accepts (leap years by the Gregorian rule)."""

TIME_REGEX = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
              r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
"""An RFC 3339 full-time with an offset, no leap second."""

DATE_TIME_REGEX = DATE_REGEX + "T" + TIME_REGEX
"""An RFC 3339 date-time (upper-case `T`)."""
