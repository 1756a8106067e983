"""Incremental detokenization with stop strings and split characters."""

from workers.text import TextStream


class Pieces:
    """Decodes ids as indexes into a list of text pieces (a byte-level tokenizer's view)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def feed(stream: TextStream, ids) -> list[str]:
    return [stream.push(i) for i in ids]


def test_plain_text_goes_out_token_by_token():
    s = TextStream(Pieces(["Hel", "lo", " world"]))
    assert feed(s, [0, 1, 2]) == ["Hel", "lo", " world"]
    assert s.flush() == ""


def test_a_stop_string_split_over_tokens_is_held_back_and_never_sent():
    s = TextStream(Pieces(["Hi", " the", "re", " EN", "D!", "more"]), stop=[" END"])
    out = feed(s, [0, 1, 2, 3, 4])
    assert "".join(out) == "Hi there"
    assert s.stopped and s.flush() == ""


def test_held_text_comes_out_at_the_end_when_no_stop_matched():
    s = TextStream(Pieces(["a", "b", "c"]), stop=["xyz"])
    out = feed(s, [0, 1, 2])
    assert out == ["", "", "a"]
    assert s.flush() == "bc"


def test_a_half_character_waits_for_its_other_half():
    # the second id alone decodes to a replacement char; with the third it is "é"
    class Joined(Pieces):
        def decode(self, ids):
            text = super().decode(ids)
            return text.replace("\ufffdé", "é")

    s = TextStream(Joined(["caf", "\ufffd", "é"]))
    assert feed(s, [0, 1, 2]) == ["caf", "", "é"]


def test_a_resumed_stream_continues_after_what_was_sent():
    s = TextStream(Pieces(["one", " two", " three"]), ids=[0, 1], emitted="one two")
    assert s.push(2) == " three"
