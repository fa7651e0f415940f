"""llguidance JSON compile options shared by the tokenizer (tool-call grammars)
and the worker (json_schema grammars), in a module free of torch.

`{"a": 1, "b": 2}` as json.dumps writes it: free whitespace lets small models
wander into endless blank lines while staying "valid"."""
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
