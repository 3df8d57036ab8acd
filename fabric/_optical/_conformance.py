"""The OCS driver conformance suite: what every :class:`~orchestr.fabric._optical._ocs.OcsDriver` must do.

``await check_ocs_driver(make_driver)`` runs each check on a fresh driver from ``make_driver``
(a function returning a driver, or an awaitable of one) and returns the failures, one line each
(``"check: what went wrong"``); an empty list means the driver conforms. ``make_driver`` must
give a switch with no circuits and at least 6 ports. Every check runs under a deadline, so a
driver that hangs fails instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from orchestr.errors import ClosedResourceError

from ._ocs import InvalidProgramError, OcsDriver, OcsError, StaleGenerationError, VerifyError

__all__ = ["CHECKS", "check_ocs_driver"]

MakeDriver = Callable[[], OcsDriver | Awaitable[OcsDriver]]


class _Failed(Exception):
    """A conformance check found the driver wrong."""


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise _Failed(what)


async def _state(d: OcsDriver) -> tuple[int, frozenset[tuple[int, int]]]:
    gen, live = await d.circuits()
    _expect(
        isinstance(gen, int) and isinstance(live, frozenset),
        f"circuits() returned {(gen, live)!r}, not (int, frozenset)",
    )
    return gen, live


async def _refused(
    d: OcsDriver, error: type[Exception], gen: int, connect: Any, disconnect: Any, what: str
) -> None:
    before = await _state(d)
    try:
        await d.program(gen, connect, disconnect)
    except error:
        pass
    except Exception as exc:
        raise _Failed(f"{what}: raised {type(exc).__name__}, not {error.__name__}") from exc
    else:
        raise _Failed(f"{what}: accepted, should raise {error.__name__}")
    after = await _state(d)
    _expect(after == before, f"{what}: a refused program changed the switch {before} -> {after}")


async def check_empty(d: OcsDriver) -> None:
    """A new switch reports its radix and no circuits."""
    _expect(isinstance(d.radix, int) and d.radix >= 6, f"radix {d.radix!r}: need an int >= 6")
    _, live = await _state(d)
    _expect(not live, f"a new switch has circuits {sorted(live)}; make_driver must give none")


async def check_program_readback(d: OcsDriver) -> None:
    """Programs apply atomically and read back normalized, under their generation."""
    g, _ = await _state(d)
    await d.program(g + 1, [(0, 1), (3, 2)], [])
    got = await _state(d)
    _expect(got == (g + 1, frozenset({(0, 1), (2, 3)})), f"after connect read back {got}")
    await d.verify(g + 1, [(0, 1), (2, 3)])
    await d.program(g + 2, [(1, 2), (0, 3)], [(0, 1), (2, 3)])
    got = await _state(d)
    _expect(got == (g + 2, frozenset({(1, 2), (0, 3)})), f"after a swap read back {got}")
    await d.program(g + 3, [(1, 2)], [(2, 1)])  # remake the same circuit in one program
    got = await _state(d)
    _expect(got == (g + 3, frozenset({(1, 2), (0, 3)})), f"after a remake read back {got}")
    await d.program(g + 4, [], [(0, 3), (1, 2)])
    got = await _state(d)
    _expect(got == (g + 4, frozenset()), f"after disconnecting all read back {got}")


async def check_verify(d: OcsDriver) -> None:
    """verify raises VerifyError for a wrong set or a wrong generation, and passes otherwise."""
    g, _ = await _state(d)
    await d.program(g + 1, [(0, 1)], [])
    await d.verify(g + 1, [(1, 0)])
    for gen, expected, what in (
        (g + 1, [(0, 1), (2, 3)], "a missing circuit"),
        (g + 1, [], "an extra circuit"),
        (g, [(0, 1)], "an old generation"),
    ):
        try:
            await d.verify(gen, expected)
        except VerifyError:
            continue
        raise _Failed(f"verify passed with {what}")


async def check_invalid_is_atomic(d: OcsDriver) -> None:
    """Each invalid program raises InvalidProgramError and changes nothing, generation included."""
    g, _ = await _state(d)
    await d.program(g + 1, [(0, 1), (2, 3)], [])
    r = d.radix
    bad: list[tuple[Any, Any, str]] = [
        ([(4, r)], [], "a port equal to the radix"),
        ([(-1, 4)], [], "a negative port"),
        ([(4, 4)], [], "a port joined to itself"),
        ([(4, 5), (5, 4)], [], "a port used twice in one program"),
        ([(4, 5), (1, 5)], [(0, 1)], "a freed port used twice"),
        ([(1, 4)], [], "a port already in a circuit not being disconnected"),
        ([(4, 5)], [(0, 4)], "disconnecting a circuit that is not live"),
        ([(4, 5)], [(0, 1), (1, 0)], "disconnecting one circuit twice"),
        ([(4, 5), ("a", 3)], [], "a port that is not an integer"),
        ([(4, 5), (1, 4)], [(2, 3)], "a valid part followed by an invalid one"),
    ]
    for connect, disconnect, what in bad:
        await _refused(d, InvalidProgramError, g + 2, connect, disconnect, what)
    _expect(issubclass(InvalidProgramError, ValueError), "InvalidProgramError is a ValueError")
    await d.program(g + 2, [(4, 5)], [])  # the refused programs did not consume the generation
    got = await _state(d)
    _expect(got == (g + 2, frozenset({(0, 1), (2, 3), (4, 5)})), f"then read back {got}")


async def check_generations(d: OcsDriver) -> None:
    """Generations only grow; an old or equal one is refused; an empty program is a fence."""
    g, _ = await _state(d)
    await d.program(g + 5, [(0, 1)], [])
    await _refused(d, StaleGenerationError, g + 5, [(2, 3)], [], "a repeated generation")
    await _refused(d, StaleGenerationError, g + 1, [(2, 3)], [], "an older generation")
    await _refused(d, StaleGenerationError, g + 1, [], [(0, 1)], "an older disconnect")
    _expect(issubclass(StaleGenerationError, OcsError), "StaleGenerationError is an OcsError")
    await d.program(g + 6, [], [])
    got = await _state(d)
    _expect(got == (g + 6, frozenset({(0, 1)})), f"an empty program read back {got}")
    await _refused(d, StaleGenerationError, g + 5, [], [], "an empty older program")


async def check_close(d: OcsDriver) -> None:
    """aclose is idempotent; calls after it raise ClosedResourceError."""
    await d.aclose()
    await d.aclose()
    calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("program", lambda: d.program(10**6, [(0, 1)], [])),
        ("circuits", d.circuits),
        ("verify", lambda: d.verify(0, [])),
    ]
    for name, call in calls:
        try:
            await call()
        except ClosedResourceError:
            continue
        except Exception as exc:
            raise _Failed(f"{name} after aclose raised {type(exc).__name__}") from exc
        raise _Failed(f"{name} after aclose did not raise ClosedResourceError")


CHECKS: tuple[Callable[[OcsDriver], Awaitable[None]], ...] = (
    check_empty,
    check_program_readback,
    check_verify,
    check_invalid_is_atomic,
    check_generations,
    check_close,
)


async def check_ocs_driver(make_driver: MakeDriver, *, deadline_s: float = 30.0) -> list[str]:
    """Run every check on a fresh driver; returns the failures (empty: the driver conforms).

    Blocks on the drivers; each check has ``deadline_s``. Never raises for a driver's fault.
    Cancel-safe: each driver is closed however its check ends.
    """
    failures: list[str] = []
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        try:
            made = make_driver()
            driver = made if isinstance(made, OcsDriver) else await made
        except Exception as exc:
            failures.append(f"{name}: make_driver raised {type(exc).__name__}: {exc}")
            continue
        try:
            async with asyncio.timeout(deadline_s):
                await check(driver)
        except _Failed as exc:
            failures.append(f"{name}: {exc}")
        except TimeoutError:
            failures.append(f"{name}: did not finish within {deadline_s:g} s")
        except Exception as exc:
            failures.append(f"{name}: unexpected {type(exc).__name__}: {exc}")
        finally:
            try:
                await driver.aclose()
            except Exception as exc:
                failures.append(f"{name}: aclose raised {type(exc).__name__}: {exc}")
    return failures
