"""Times written as text that names its offset: read exactly, or not at all.

A legacy `created_at` may be an RFC 2822 date (HTTP's and e-mail's, JavaScript's
`Date.toUTCString()`) or JavaScript's `Date.toString()`. Each is read whole: the offset it
names is applied, a weekday must be the date's, and text that does not fit the form to its
end (AM or PM, a zone's name no standard defines, a two-digit year, anything left over) is
no time. A time misread is worse than none: it reorders a conversation silently, where no
time is a `missing_created_at` problem.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_ZONE_HOURS = {
    "ut": 0, "utc": 0, "gmt": 0,
    "est": -5, "edt": -4, "cst": -6, "cdt": -5, "mst": -7, "mdt": -6, "pst": -8, "pdt": -7,
}  # fmt: skip
"""The zone names RFC 2822 defines (§4.3: UT, GMT and the North American ones; UTC as UT),
by their offset in hours. Its military letters it says to read as unknown: they are none."""

_WEEKDAY = r"(?P<weekday>" + "|".join(_WEEKDAYS) + r")"
_MONTH = r"(?P<month>" + "|".join(_MONTHS) + r")"
_CLOCK = r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2})"
_OFFSET = r"(?P<offset>[+-][0-9]{2}:?[0-9]{2})"
_RFC_2822 = re.compile(
    rf"(?:{_WEEKDAY}\s*,\s*)?(?P<day>[0-9]{{1,2}})\s+{_MONTH}\s+(?P<year>[0-9]{{4}})\s+"
    rf"{_CLOCK}(?::(?P<second>[0-9]{{2}}))?\s+"
    rf"(?:{_OFFSET}|(?P<zone>" + "|".join(_ZONE_HOURS) + r"))",
    re.IGNORECASE,
)
"""RFC 2822's date-time (its obsolete spaces and zone names too, and an offset written with
a colon, `+02:00`, which says the same)."""
_JAVASCRIPT = re.compile(
    rf"{_WEEKDAY} {_MONTH} (?P<day>[0-9]{{2}}) (?P<year>[0-9]{{4}}) "
    rf"{_CLOCK}:(?P<second>[0-9]{{2}}) GMT{_OFFSET}(?: \([^()]*\))?",
    re.IGNORECASE,
)
"""JavaScript's `Date.toString()`: `Fri Mar 01 2024 10:30:00 GMT+0200 (Central European
Standard Time)`; the offset says the time, the zone's name in parentheses only names it."""


def text_time(text: str) -> datetime | None:
    """The aware time an RFC 2822 date or a JavaScript `Date.toString()` says, at the offset
    it names (`-0000`, RFC 2822's unknown local zone, as UTC); None when `text` is neither,
    whole (see the module)."""
    found = _RFC_2822.fullmatch(text) or _JAVASCRIPT.fullmatch(text)
    if found is None:
        return None
    fields = found.groupdict()
    try:
        at = datetime(
            int(fields["year"]),
            _MONTHS.index(fields["month"].lower()) + 1,
            int(fields["day"]),
            int(fields["hour"]),
            int(fields["minute"]),
            int(fields["second"] or 0),
            tzinfo=timezone(_offset(fields["offset"], fields.get("zone"))),
        )
    except ValueError:  # no such day or hour (31 Feb, 25:00, a leap second), an offset of a day
        return None
    weekday = fields["weekday"]
    return None if weekday and _WEEKDAYS.index(weekday.lower()) != at.weekday() else at


def _offset(offset: str | None, zone: str | None) -> timedelta:
    """The offset a date names, as `+hhmm` (`+hh:mm`) or by a zone's name."""
    if offset is None:
        return timedelta(hours=_ZONE_HOURS[str(zone).lower()])
    digits = offset[1:].replace(":", "")
    size = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    if int(digits[2:]) >= 60:
        raise ValueError(f"no offset has {digits[2:]} minutes")
    return -size if offset[0] == "-" else size
