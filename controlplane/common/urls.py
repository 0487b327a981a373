"""Path converters that bound what reaches the database: names by the wire contract, generations
of at most nine digits (a larger number is a 404, never an integer overflow)."""

from relay_engine.core.wire import NAME_RE

POOL_NAME_PATTERN = NAME_RE.pattern.strip("^$")
GENERATION_PATTERN = "[0-9]{1,9}"
INSTANCE_NAME_PATTERN = POOL_NAME_PATTERN + r"\.[0-9]{1,4}"  # wire.instance_name: <pool>.<index>


class PoolNameConverter:
    regex = POOL_NAME_PATTERN

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


class GenerationConverter:
    regex = GENERATION_PATTERN

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


class InstanceNameConverter(PoolNameConverter):
    regex = INSTANCE_NAME_PATTERN
