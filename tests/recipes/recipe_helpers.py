"""Helpers for the recipe tests: a tiny local data set of English prose."""

from __future__ import annotations

from pathlib import Path

TEXT = """The for statement is used to iterate over the elements of a sequence (such as a string,
tuple or list) or other iterable object. The first expression list is evaluated once; it should
yield an iterable object. An iterator is created for the result of that iterable.
The suite is then executed once for each item provided by the iterator, in the order returned by
the iterator. Each item in turn is assigned to the target list using the standard rules for
assignments, and then the suite is executed. When the items are exhausted, the suite in the else
clause, if present, is executed, and the loop terminates.
"""


def write_text_data(d: Path, copies: int = 20) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / "train.txt"
    p.write_text("\n\n".join(TEXT.replace("sequence", f"sequence {i}") for i in range(copies)))
    return p
