"""A settable clock for pure tests of time-based logic (`clock.now += 5`)."""


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
