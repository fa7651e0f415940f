from services.tokenizer.stop_strings import StopStringMatcher


def feed_all(matcher, pieces):
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_no_stops_passes_through():
    assert feed_all(StopStringMatcher([]), ["ab", "cd"]) == "abcd"


def test_stop_split_across_pieces_is_found_and_cut():
    m = StopStringMatcher(["STOP"])
    assert feed_all(m, ["hello S", "TO", "P world"]) == "hello "
    assert m.is_stopped


def test_include_stop_string():
    assert feed_all(StopStringMatcher(["STOP"], include_in_output=True), ["a ST", "OP b"]) == "a STOP"


def test_partial_match_is_held_back_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("ar") == "STar"
    assert not m.is_stopped


def test_held_text_is_flushed_at_the_end():
    m = StopStringMatcher(["STOP"])
    assert m.feed("x S") == "x "
    assert m.flush() == "S"


def test_earliest_of_several_stops_wins():
    assert feed_all(StopStringMatcher(["world", "lo"]), ["hello world"]) == "hel"
