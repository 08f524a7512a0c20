"""Problem sets, the toy task, its tokenizer and its SFT demonstrations."""
