"""fake_cupy's streams, events and devices: kernels wait in the current stream's queue and run only
when it is synchronized (or an event recorded after them is waited for); the current device."""

import os
import threading


class Stream:
    """``cupy.cuda.Stream``: kernels launched while it is current wait in it until synchronized."""

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.null = null
        self._pending = []
        self._launched = 0  # kernels ever queued here
        self._started = 0  # kernels taken off the queue (run, or running)
        self._lock = threading.RLock()

    def launch(self, kernel):
        with self._lock:
            self._pending.append(kernel)
            self._launched += 1

    def _run_until(self, position):
        """Run queued kernels, in order, until the first ``position`` ever queued have run."""
        with self._lock:
            while self._started < position and self._pending:
                kernel = self._pending.pop(0)
                self._started += 1
                kernel()

    def synchronize(self):
        self._run_until(float("inf"))

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        """Kernels queued here after this call wait until ``event``'s point in its stream is
        reached."""
        stream, position = event._stream, event._position
        if stream is not None:
            self.launch(lambda: stream._run_until(position))

    def use(self):
        _current.stream = self
        return self

    def __enter__(self):
        _current.stack = getattr(_current, "stack", []) + [get_current_stream()]
        return self.use()

    def __exit__(self, *exc):
        _current.stream = _current.stack.pop()

    @property
    def done(self):
        return not self._pending


class Event:
    """``cupy.cuda.Event``: marks a point in a stream (everything queued there so far)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._stream = None
        self._position = 0

    def record(self, stream=None):
        self._stream = get_current_stream() if stream is None else stream
        self._position = self._stream._launched

    def synchronize(self):
        if self._stream is not None:
            self._stream._run_until(self._position)

    @property
    def done(self):
        return self._stream is None or self._stream._started >= self._position


_null_stream = Stream(null=True)
Stream.null = _null_stream
_current = threading.local()


def get_current_stream():
    return getattr(_current, "stream", None) or _null_stream


def _launch(kernel):
    get_current_stream().launch(kernel)


def _device_count():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return int(os.environ.get("FAKE_CUPY_DEVICE_COUNT", "1"))


class _Device:
    _selected = 0

    def __init__(self, device=None):
        self.id = _Device._selected if device is None else int(device)

    def use(self):
        if not 0 <= self.id < _device_count():
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        _Device._selected = self.id

    def synchronize(self):
        _null_stream.synchronize()

    def __enter__(self):
        self._previous = _Device._selected
        self.use()
        return self

    def __exit__(self, *exc):
        _Device._selected = self._previous
