"""Small Hugging Face tokenizer files built on the spot with the `tokenizers` library."""
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird sang a song",
]


def word_level(words, special_tokens=("[UNK]", "<|endoftext|>")) -> Tokenizer:
  tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=list(special_tokens)))
  return tok


@pytest.fixture
def word_tokenizer_path(tmp_path):
  """WordLevel over SENTENCES, with "<|endoftext|>" as a special token."""
  path = tmp_path / "words" / "tokenizer.json"
  path.parent.mkdir()
  word_level(SENTENCES).save(str(path))
  return str(path)


@pytest.fixture
def bpe_no_eos_path(tmp_path):
  """Byte-level BPE with no EOS-like token in its vocabulary."""
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES * 3, trainer)
  path = tmp_path / "bpe.json"
  tok.save(str(path))
  return str(path)


@pytest.fixture
def erasing_tokenizer_path(tmp_path):
  """A tokenizer whose normalizer deletes every lowercase letter: lowercase text has no tokens."""
  tok = word_level(SENTENCES)
  tok.normalizer = normalizers.Replace(Regex("[a-z]"), "")
  path = tmp_path / "erasing.json"
  tok.save(str(path))
  return str(path)


@pytest.fixture
def unique_words(tmp_path):
  """(text path, tokenizer path): 500 distinct words, one token each: an id names a position."""
  words = [f"w{i}" for i in range(500)]
  text = tmp_path / "words.txt"
  text.write_text(" ".join(words))
  tok = tmp_path / "unique.json"
  word_level([" ".join(words)]).save(str(tok))
  return str(text), str(tok)
