"""Size limits for files read from pull requests (checked before any parsing)."""

MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 12
MAX_ITEMS = 200_000
MAX_INT_DIGITS = 30  # any count capplan handles fits in far fewer digits
MAX_LINE_BYTES = 64 * 1024  # one line of a JSON-lines trace or query file
MAX_TRACE_BYTES = 256 * 1024 * 1024
