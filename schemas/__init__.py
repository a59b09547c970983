"""The language-neutral contract of trajstore: the event log's Arrow schema and a JSON Schema of one event.

The JSON files beside this module are the source of truth; `trajstore.schema` loads them at import.
"""
