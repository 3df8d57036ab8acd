"""A controller's event log sent to the head as it grows (:class:`EventShipper`), so the head's
dashboard shows a job whose controller runs on another host: ``orchestr run --address HEAD``,
``oc.connect``. An embedded cluster's head reads the log from disk, as it does a submitted
job's, so neither sends it.

Once a second the shipper reads what the log gained (whole lines, at most 1 MiB at a time)
and sends it with the job's state (nothing when there is nothing new to say); the head answers where it holds the log up to, and the
next send starts there (a lost reply costs one send again, which the head takes once). A head
that shows no events (no dashboard) is asked once; an unreachable head again at the next
tick. Nothing it does fails the job.
"""

from __future__ import annotations

import asyncio
import os

import structlog

from orchestr._control._head_client import HeadClient
from orchestr.errors import ConfigError, OrchestrError

__all__ = ["EventShipper"]

log = structlog.get_logger("orchestr.job")

#: Most bytes one send carries (the head's bound).
MAX_SEND_BYTES = 1 << 20


class EventShipper:
    """Sends ``path`` (job ``job_id``'s event log, ``title`` what it runs) to the head."""

    def __init__(
        self, head: HeadClient, job_id: str, title: str, path: str, period_s: float = 1.0
    ) -> None:
        self.head = head
        self.job_id = job_id
        self.title = title
        self.path = path
        self.period_s = period_s
        #: Where the head holds the log up to.
        self.offset = 0
        #: False once the head said it shows no events (or refused one).
        self.wanted = True
        self._said = ""  # the state the head last took

    async def run(self) -> None:
        """Send what the log gains, once a period, until cancelled."""
        while self.wanted:
            await self.send("running")
            await asyncio.sleep(self.period_s)

    async def finish(self, state: str) -> None:
        """Send the rest of the log and the job's last ``state``; bounded by 5 seconds (a
        head that does not answer does not hold up the job's end)."""
        try:
            async with asyncio.timeout(5.0):
                while self.wanted and await self.send(state):
                    pass
        except TimeoutError:
            log.debug("the head did not take the event log's end", job=self.job_id)

    async def send(self, state: str) -> bool:
        """Send the log's next lines and ``state``; whether more remains to send."""
        data, more = await asyncio.to_thread(self._read)
        if not data and not more and state == self._said:
            return False  # nothing new to say: no call
        if more and not data:
            self.wanted = False  # one line of over 1 MiB: the head would take none of it
            log.debug("an event line too long to send; the rest stays here", job=self.job_id)
            return False
        start = self.offset
        try:
            self.offset = await self.head.job_events(self.job_id, self.title, state, start, data)
        except ConfigError as exc:
            self.wanted = False
            log.debug("the head takes no event log", job=self.job_id, reason=str(exc))
            return False
        except OrchestrError as exc:
            log.debug("the event log could not be sent", job=self.job_id, error=str(exc))
            return False
        self._said = state
        # the head holds less than was sent (a gap it saw) or the read was cut: go on
        return more or self.offset != start + len(data)

    def _read(self) -> tuple[bytes, bool]:
        """The log's whole lines from :attr:`offset` (at most :data:`MAX_SEND_BYTES`), and
        whether the read stopped at that bound."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return b"", False
        try:
            data = os.pread(fd, MAX_SEND_BYTES, self.offset)
        finally:
            os.close(fd)
        return data[: data.rfind(b"\n") + 1], len(data) == MAX_SEND_BYTES
