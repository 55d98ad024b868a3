"""Size limits for files read from pull requests (checked before any parsing)."""

MAX_FILE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 12
MAX_ITEMS = 200_000
