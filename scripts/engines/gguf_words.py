"""llama.cpp's own converter (convert_hf_to_gguf.py) on a `refgen export`, its vocabulary written
as the export's words.

    python3 gguf_words.py LLAMA_CPP_SOURCE EXPORT_DIR --outfile model.gguf --outtype f32

The converter refuses the export's word-level tokenizer ("BPE pre-tokenizer was not
recognized"): every model class it has reads a real tokenizer. Here the model class is the
converter's own (tensor names, MLA split, rope scaling: all its code), with one method replaced
(its registry refuses a subclass):
the vocabulary is written as llama.cpp's "rwkv" model, token i the text " t<i>" (the export's
word t<i>, a space before it), normal tokens, no special ones. The server then detokenizes a
reply to " t762 t465 ...", which the client reads back through the export's tokenizer.json, and
no token is an end-of-generation token that `ignore_eos` would mask.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    source = Path(sys.argv[1])
    sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import convert_hf_to_gguf as convert
    import gguf

    model_class = convert.get_model_class

    def set_vocab(self) -> None:
        n = self.hparams["vocab_size"]
        self.gguf_writer.add_tokenizer_model("rwkv")
        self.gguf_writer.add_token_list([f" t{i}" for i in range(n)])
        self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)

    def with_words(architecture: str, mmproj: bool = False) -> type:
        chosen = model_class(architecture, mmproj=mmproj)
        chosen.set_vocab = set_vocab             # this process only: its one conversion
        return chosen

    convert.get_model_class = with_words
    convert.main()


if __name__ == "__main__":
    main()
