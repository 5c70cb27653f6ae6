"""A tidying pass over each generated tile function, so that the dumped kernel reads like written code:
no ``x * 1``, no ``0 + x`` or ``x + 0``, no loop that runs once, no variable declared and never used.
Every rewrite keeps the meaning (the same value, type and order of side effects); what a rewrite
cannot prove safe it leaves alone.
"""

from __future__ import annotations

import re

# "* 1" as a factor (not 1.0f, 16, 1LL, 1u): x * 1 is x, in the same type, for every operand we emit
_TIMES_ONE = re.compile(r" \* 1(?![\w.])|(?<=[(=,?:+-] )1 \* |(?<=\()1 \* ")
# "+ 0 * x" (a one-trip loop's index, read as 0): a term that is 0
_ZERO_TERM = re.compile(r" \+ 0 \* (?:\([\w:]+\))?[\w.]+(?=[;),\]]| [^*/%])")
# "0 + " opening an operand (after "(", "=", ",", "?", ":" or "return"), "+ 0" closing one
_ZERO_PLUS = re.compile(r"(?<=[(=,?:] )0 \+ |(?<=\()0 \+ |(?<=return )0 \+ ")
_PLUS_ZERO = re.compile(r" \+ 0(?=[;),\]])")
# for (int u = 0; u < 1; ++u) {   (one trip: u is 0)
_ONE_TRIP = re.compile(
    r"^(?P<indent>[ \t]*)for \((?:int|unsigned) (?P<var>\w+) = 0; (?P=var) < 1; \+\+(?P=var)\) (?P<rest>.*)$"
)
_BREAK_IF = re.compile(r"^(?P<indent>[ \t]*)if \((?P<cond>.*)\) break;$")
# declarations a rewrite may drop when the name is never read: the emitters' pointers and scratch
_DECLARED = re.compile(
    r"^[ \t]*\[\[maybe_unused\]\] (?P<decl>[^=;]*?\b(?P<name>\w+)(?:\[\w+\])?(?: = [^;]*)?;)(?P<tail>.*)$"
)


def tidy(lines: list[str]) -> list[str]:
    """The tile function's lines, tidied (see the module's doc)."""
    text = _arithmetic("\n".join(lines))
    text = _arithmetic("\n".join(_unroll_one_trips(text.split("\n"))))  # (an unrolled index reads 0)
    return _drop_unused(text.split("\n"))


def _arithmetic(text: str) -> str:
    text = _TIMES_ONE.sub("", text)
    previous = None
    while previous != text:  # "0 + 0 + x" and the like
        previous = text
        text = _PLUS_ZERO.sub("", _ZERO_PLUS.sub("", _ZERO_TERM.sub("", text)))
    return text


def _code(line: str) -> str:
    """The line without its // comment and string literals (for brace and name counts)."""
    line = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
    return line.split("//", 1)[0]


def _body_end(lines: list[str], start: int) -> int | None:
    """Index of the line closing the block opened at the end of line ``start`` (alone on its line)."""
    depth = 0
    for i in range(start, len(lines)):
        code = _code(lines[i])
        depth += code.count("{") - code.count("}")
        if depth == 0:
            return i if i > start and code.strip() == "}" else None
    return None


def _unroll_one_trips(lines: list[str]) -> list[str]:
    """``for (int u = 0; u < 1; ++u) body`` -> ``body`` with u read as 0, where the body leaves the loop
    by no break or continue (which would then leave another loop), but for a first ``if (c) break;``,
    which becomes ``if (!(c)) { the rest }``."""
    i = 0
    while i < len(lines):
        m = _ONE_TRIP.match(lines[i])
        done = m is not None and _unroll_at(lines, i, m)
        if done and i > 0 and lines[i - 1].strip() == "#pragma unroll":  # (nothing left to unroll)
            del lines[i - 1]
            i -= 1
        i += 1
    return lines


def _leaves(lines: list[str]) -> bool:
    return any(re.search(r"\b(break|continue)\b", _code(x)) for x in lines)


def _unroll_at(lines: list[str], i: int, m: re.Match[str]) -> bool:
    var = re.compile(rf"(?<![\w.>:']){m['var']}\b")
    rest = m["rest"]
    code = _code(rest)
    if not code.startswith("{") or code.count("{") == code.count("}"):  # on one line
        if code.count("{") != code.count("}") or _leaves([rest]):
            return False
        lines[i] = m["indent"] + var.sub("0", rest)
        return True
    if code.strip() != "{":
        comment = rest[1:].strip()
    else:
        comment = ""
    end = _body_end(lines, i)
    if end is None:
        return False
    body = [var.sub("0", b) for b in lines[i + 1 : end]]
    head = f"{m['indent']}{{{'  ' + comment if comment else ''}"
    first = _BREAK_IF.match(body[0]) if body else None
    if first is not None and not _leaves(body[1:]):
        head = f"{m['indent']}if (!({first['cond']})) {{{'  ' + comment if comment else ''}"
        body = body[1:]
    elif _leaves(body):
        return False
    lines[i : end + 1] = [head, *body, lines[end]]
    return True


def _drop_unused(lines: list[str]) -> list[str]:
    """Drop ``[[maybe_unused]]`` declarations whose name is never used again (their initialisers read
    memory at most: no side effects), and the attribute from those that are used."""
    code = [_code(line) for line in lines]
    out = []
    for i, line in enumerate(lines):
        m = _DECLARED.match(line)
        if m is None:
            out.append(line)
            continue
        name = re.compile(rf"(?<![\w.>:]){m['name']}\b")
        used = any(name.search(c) for k, c in enumerate(code) if k != i) or name.search(_code(m["tail"]))
        if used:
            out.append(line.replace("[[maybe_unused]] ", "", 1))
        elif _code(m["tail"]).strip():
            out.append(line[: len(line) - len(line.lstrip())] + m["tail"].strip())
    return out
