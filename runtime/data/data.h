// data.h: pre-tokenised training data. Text becomes token ids (tokenizer.c: bytes plus learned BPE
// merges), `mdlc prep` writes them as llm.c-format shards (prep.c, shard.c), and the loader
// (loader.c) memory-maps the shards and hands out B x T batches, packed or padded, in order or
// shuffled, prepared one batch ahead by a background thread. Each section lists one file's API.
#ifndef MDL_DATA_H
#define MDL_DATA_H
#include "mdl.h"

#include <sys/types.h>

//
// tokenizer.c: byte-level BPE. Ids 0..255 are the bytes, except id 0 (NUL, which text never
// holds) which is EOS, the token that starts every document. Merge r makes id 256 + r.
//
#define TOK_EOS 0
#define TOK_MAX_VOCAB 65536 // ids must fit the shards' uint16
#define TOK_MAX_WORD 128    // longer runs are cut into pieces of at most this many bytes

typedef struct Tokenizer Tokenizer;

// A growing array of token ids (encode appends to it).
typedef struct {
  int32_t *ids;
  size_t n, cap;
} TokBuf;

// The end of the pre-split word that starts at text[i] (i < n): a run of letters (ASCII letters
// and every byte >= 0x80, so UTF-8 text stays whole), of digits, or of other bytes, each with
// its one leading space; or a run of whitespace, less its last space when a word follows.
size_t tok_word_end(const char *text, size_t n, size_t i);

// A tokenizer from its merges (pairs[2r], pairs[2r+1] make id 256 + r); NULL/0 gives the byte
// level tokenizer (vocab 256). Returns NULL with a reason in why when the merges are invalid.
Tokenizer *tok_new(const uint32_t *pairs, int nmerges, char *why, size_t nwhy);
void tok_free(Tokenizer *t);
int tok_vocab(const Tokenizer *t);                       // 256 + number of merges
int tok_merges(const Tokenizer *t, const uint32_t **pairs); // number of merges; *pairs in rank order
// Appends the ids of text (no EOS) to out; returns how many. Merges apply by rank, per word,
// through a cache of encoded words (hence not const, and not for two threads at once).
size_t tok_encode(Tokenizer *t, const char *text, size_t n, TokBuf *out);
// Writes the bytes of ids to out (at most cap of them) and returns their full count. EOS decodes
// to nothing, so decode(encode(text)) == text; ids outside the vocab decode to U+FFFD.
size_t tok_decode(const Tokenizer *t, const int32_t *ids, size_t n, char *out, size_t cap);
// DIR/tokenizer.bin: "MDLTOK1\0", u32 vocab, u32 number of merges, then the merges as pairs of
// u32 in rank order, little-endian. Save writes atomically; both print "path: error: reason".
bool tok_save(const Tokenizer *t, const char *path);
Tokenizer *tok_load(const char *path);
// The same from memory: the file's n bytes (malloc'd; checkpoints store them), and back (name is
// for the messages).
unsigned char *tok_bytes(const Tokenizer *t, size_t *n);
Tokenizer *tok_parse(const unsigned char *buf, size_t n, const char *name);

// The BPE trainer: add text (split into words and counted once), then learn merges over the word
// table, the most frequent adjacent pair first (ties: the smallest pair of ids).
typedef struct TokTrainer TokTrainer;
TokTrainer *tok_trainer_new(void);
void tok_trainer_add(TokTrainer *tr, const char *text, size_t n);
// Learns up to vocab - 256 merges, stopping early when no pair occurs twice; calls progress (may
// be NULL) now and then. Returns the tokenizer, or NULL when vocab is outside 256..65536.
Tokenizer *tok_train(TokTrainer *tr, int vocab, void (*progress)(void *ctx, int done, int total), void *ctx);
void tok_trainer_free(TokTrainer *tr);

//
// shard.c: llm.c token shards: a header of 256 little-endian int32 ([0] magic 20240520,
// [1] version 1, [2] token count), then the tokens as uint16. Files are written atomically.
//
#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_BYTES 1024

// Atomic file writing: write to a temporary file next to path, then fsync and rename.
typedef struct {
  FILE *f;
  char *path, *tmp;
} DataFile;
bool datafile_open(DataFile *d, const char *path); // prints "path: error: reason" on failure
bool datafile_commit(DataFile *d);                 // fsync, rename, fsync the folder; closes
void datafile_abort(DataFile *d);                  // removes the temporary file

typedef struct {
  DataFile file;
  int64_t n; // tokens written so far
} ShardWriter;
bool shard_writer_open(ShardWriter *w, const char *path);
bool shard_writer_put(ShardWriter *w, const uint16_t *tokens, size_t n);
bool shard_writer_finish(ShardWriter *w); // fills in the header's token count, commits
bool shard_write(const char *path, const uint16_t *tokens, int64_t n);

// A shard mapped read-only. Open validates it: size >= 1024 bytes, magic, version, token count
// against the file size, and, when vocab > 0, every token < vocab (up front: one pass over the
// mapping). Errors name the file: "PATH: error: truncated: header says 5000 tokens, file holds 1200".
typedef struct {
  char *path;
  const uint16_t *tokens;
  int64_t n;
  void *map;
  size_t map_bytes;
} Shard;
bool shard_open(Shard *s, const char *path, int64_t vocab);
bool shard_map(Shard *s, const char *path, int64_t vocab, char *why, size_t n); // (shard_open, the reason in why)
void shard_close(Shard *s);
// The shards of one split in DIR, sorted by name: files ending in ".bin" whose name starts with
// "SPLIT_" or holds "_SPLIT_" or "_SPLIT." (so llm.c's fineweb_train_000001.bin and
// tiny_shakespeare_val.bin are found too). Returns the count (paths in *out, malloc'd), or -1
// after printing why DIR cannot be read.
int shard_list(const char *dir, const char *split, char ***out);
void shard_list_free(char **paths, int n);

//
// corpus.c: the documents of a text input as `mdlc prep` finds them (prep reads them to write the
// shards; `mdlc run --tokenize-on-the-fly` reads them again as it trains), and DIR/source.txt,
// prep's record of the text it read and how it split it.
//
typedef struct {
  char *path;
  dev_t dev;
  ino_t ino;
  int64_t size, mtime_ns; // as stat gave them when the file was found (prep: when it first read it)
  bool jsonl;             // a *.jsonl file: one JSON object a line, its text field a document
  bool binary;            // holds NUL bytes: not text, skipped (prep finds it when it reads the file)
  bool seen;              // the same file as an earlier one (a symlink or hard link to it), skipped
  bool skip;              // binary or seen
} CorpusFile;

typedef struct {
  char *root;         // the input, less a trailing '/'
  bool folder;        // the input is a folder (else one file)
  CorpusFile *files;  // every file under the folder, recursively, in path order; or the input file
  int nfiles, cap;
  int skipped_seen, skipped_other;
  int64_t total_bytes; // of the files not skipped
} Corpus;

// The input's files: names starting with '.' are left out, a folder reached twice (a symlink) is
// walked once, and a file seen before is marked seen. Notes name what is skipped (unless quiet).
// False after printing why the input cannot be read.
bool corpus_find(Corpus *c, const char *input, bool quiet);
void corpus_free(Corpus *c);

typedef struct {
  char *s;
  size_t n, cap;
} CorpusText;

// The documents of one file: a JSONL file's text fields (blank lines skipped), a text file's parts
// between the lines equal to doc_sep (the separator lines dropped; a trailing '\r' ignored), or the
// whole file. Empty documents are left out.
typedef struct {
  const char *doc_sep, *text_field; // as prep's options (doc_sep NULL: none); set by the caller
  const char *path;
  bool jsonl;
  const char *map; // the file, mapped (NULL when empty)
  size_t n;
  int64_t mtime_ns;
  const char *at, *doc; // where reading goes on; with doc_sep, where the document under way starts
  int64_t line;         // JSONL lines read
  bool done;
  CorpusText key, value; // JSON strings: the document is value's text
} DocReader;
// Where the next document of a file is read from: docs_tell before a docs_next, docs_seek to
// read that document again.
typedef struct {
  int64_t at, line;
} DocPos;
bool docs_open(DocReader *r, const char *path, bool jsonl); // maps path; false after printing why
// The next document: 1 with its text (valid until the next call or docs_close), 0 at the end of the
// file, -1 after printing why ("PATH:LINE: error: no text field").
int docs_next(DocReader *r, const char **text, size_t *n);
DocPos docs_tell(const DocReader *r);
void docs_seek(DocReader *r, DocPos p);
void docs_close(DocReader *r); // unmaps the file (docs_open does so too)
void docs_free(DocReader *r);

// The split by size: documents stay whole, and each goes to val when that brings val's share of the
// bytes so far nearer the val fraction, or when none went yet and it brings val nearer its share of
// the whole input (the last goes to val when none did), else to train; a corpus of one document is
// cut in two at a line start near the val fraction from its end: the tail is val. Bytes stand for
// tokens (nearly proportional to them): they are known before anything is encoded, so the reader of
// the text decides every document as prep did, in one pass.
typedef struct {
  int64_t ndocs, bytes; // the input's documents and their bytes
  double val_fraction;
} CorpusSplit;
// The documents before the next one, in input order: their bytes, and those that went to val.
typedef struct {
  int64_t bytes, val_bytes;
} CorpusTally;
CorpusSplit corpus_split(int64_t ndocs, int64_t bytes, double val_fraction);
// The part of document i (text[0, n)) that goes to the split val (else train), the documents before
// it having gone as *t counts: text[*off, *off + *len); false when none does.
bool corpus_part(const CorpusSplit *s, const CorpusTally *t, int64_t i, bool val, const char *text, size_t n,
                 size_t *off, size_t *len);
// Counts document i (n bytes) into *t: after corpus_part, for every document of the input in order.
void corpus_tally(const CorpusSplit *s, CorpusTally *t, int64_t i, size_t n);
// The end of the piece of a document's text that starts at i: documents are encoded a megabyte at a
// time, cut at word boundaries (each piece splits into the words the whole document would).
size_t corpus_piece_end(const char *text, size_t n, size_t i);

// DIR/source.txt, written by prep (atomically) beside the shards: "KEY VALUE" lines, values to the
// end of the line with '\\', newlines and other control bytes escaped (\\, \n, \xHH); '#' lines are
// comments.
//   format mdl-source-1
//   input PATH                     the input, absolute
//   doc-sep STR                    only when given
//   text-field NAME
//   val-fraction F
//   documents N                    found in the input
//   bytes N                        in them
//   split by-size                  corpus_part's rule
//   train D documents N tokens     and the same for val
//   file text|binary SIZE S.NS PATH  every file read (binary: skipped), size, mtime, absolute path
#define SOURCE_FORMAT "mdl-source-2"
typedef struct {
  char *input, *doc_sep, *text_field;
  CorpusSplit split;
  int64_t docs[2], tokens[2]; // [0] train, [1] val
  CorpusFile *files;          // the files not seen before (binary ones marked), in path order
  int nfiles;
} Source;
bool source_write(const char *dir, const Source *s); // prints "path: error: reason" on failure
// Reads DIR/source.txt; false after printing why (a DIR without one: shards that do not say where
// they came from).
bool source_read(const char *dir, Source *s);
// Walks the input again and compares its files with the record: false after naming the first
// that was added, has gone, changed (size or mtime) or cannot be read since prep read it.
bool source_check(const Source *s, const char *dir);
// True when a file's size and mtime are those of its record; else false after saying so.
bool source_same_file(const CorpusFile *then, int64_t size, int64_t mtime_ns, const char *dir);
void source_free(Source *s);

//
// textstream.c: one split's tokens read from the text DIR/source.txt names, each document encoded
// with DIR/tokenizer.bin when a read reaches it: the stream the split's shards hold, token for token.
//
typedef struct TextStream TextStream;
// split is "train" or "val"; with index, where each of the split's documents starts is found up front
// (a pass over the text that encodes nothing), so that textstream_doc jumps to any document. NULL
// after printing why (no source.txt; the input moved, changed or unreadable since prep).
// Every token must be < vocab: a tokenizer with more is refused.
TextStream *textstream_open(const char *dir, const char *split, int64_t vocab, bool index);
int64_t textstream_tokens(const TextStream *s); // the split's tokens, as prep counted them
int64_t textstream_docs(const TextStream *s);   // the split's documents
// stream[start, start + n) into dst (start + n <= the split's tokens). Reading on from the last read
// (a start not before its start) encodes each document once; a read further back starts over from
// the first document. False after printing why (the text no longer gives prep's tokens).
bool textstream_read(TextStream *s, int64_t start, int64_t n, int32_t *dst);
// The first tokens of the split's document d (its EOS, then its text's), at most n of them, into dst;
// how many in *got. Documents before d that were not indexed are skipped, not encoded.
bool textstream_doc(TextStream *s, int64_t d, int64_t n, int32_t *dst, int64_t *got);
void textstream_close(TextStream *s);

//
// prep.c: `mdlc prep INPUT -o DIR`: text (a file, a folder, or JSONL) to shards + tokenizer.bin.
//
typedef struct {
  const char *input;      // a text file, a folder (recursively), or a *.jsonl file
  const char *out_dir;
  int vocab;              // 256 (bytes only) .. 65536
  const char *doc_sep;    // a line equal to this ends a document (NULL: none)
  const char *text_field; // the JSONL field holding the text
  double val_fraction;    // of documents, in (0, 0.5]
  int64_t shard_tokens;   // tokens per shard, at most
  bool force;             // overwrite DIR's shards
} PrepOptions;

void prep_defaults(PrepOptions *o); // vocab 256, "text", 0.05, 100,000,000 tokens per shard
// Runs prep; returns the exit status (0 ok, 1 user error) after printing errors as "path: error: ...".
int prep_run(const PrepOptions *o);

//
// permute.c: the shuffled order of an epoch, found without a table (shard and array loaders alike).
//
// The bijection of [0, n) that shuffles an epoch, chosen by (seed, epoch): a 4-round Feistel network.
int64_t loader_permute(uint64_t seed, int64_t epoch, int64_t n, int64_t i);

//
// loader.c: batches from the shards of one split, prepared one ahead by a background thread; or
// the same batches from the text the shards were made from, tokenised as each batch is drawn.
//
typedef struct {
  int64_t B, T, vocab; // vocab: the model's V; every token must be < V
  bool pack;           // pack documents into rows (else one padded document per row)
  bool shuffle;        // a permutation of the rows per epoch, from seed and epoch
  uint64_t seed;
  // Read the text DIR/source.txt names and encode the documents each batch needs in loader_next, on
  // the caller's thread, nothing prepared ahead (a naive pipeline's data loading, to measure what the
  // shards are worth): the batches the shards give. Packed rows cannot also be shuffled.
  bool from_text;
  // An array dataset (arrays.c) instead of shards: the graph whose inputs its arrays fill (B rows of
  // examples a batch; T and vocab are not read), and the share of its examples held out for the val
  // split when it has none of its own.
  const Graph *model;
  double val_fraction;
} LoaderOptions;

// One input of a batch of an array dataset: B examples' rows, i32 or f32 as the input is.
typedef struct {
  const char *name;
  const int32_t *ids; // an i32 input's values, else NULL
  const float *f;     // an f32 input's values, else NULL
  int64_t numel;
} BatchInput;

// B*T values each, owned by the loader: valid until the next loader_next or loader_close. From an
// array dataset, tokens, targets, pos and doc are NULL and inputs[0, ninputs) hold the model's inputs.
typedef struct {
  int32_t *tokens, *targets, *pos, *doc;
  int64_t real_tokens; // positions that are not padding (array datasets: the examples, B)
  const BatchInput *inputs;
  int ninputs;
} Batch;

// Where the next batch starts: the epoch, and the index in that epoch's order of its first row's
// window (packed) or document (padded).
typedef struct {
  int64_t epoch, position;
} LoaderState;

typedef struct Loader Loader;
// split is "train" or "val". Returns NULL after printing why.
Loader *loader_open(const char *dir, const char *split, LoaderOptions o);
// Hands over the prepared batch and starts preparing the next. Epochs wrap around, so there is
// always a next batch: it returns true, except from_text, false after printing why the text no
// longer gives it (a file changed since prep).
bool loader_next(Loader *l, Batch *b);
LoaderState loader_state(const Loader *l); // the state of the batch the next loader_next returns
// Makes the next batch the one at s (as returned by loader_state, in this run or an earlier one).
// Returns false after printing why when s is outside this split.
bool loader_seek(Loader *l, LoaderState s);
int64_t loader_rows(const Loader *l);   // windows (packed), documents (padded) or examples per epoch
int64_t loader_tokens(const Loader *l); // tokens in the split (array datasets: examples)
void loader_close(Loader *l);

//
// npy.c: numpy's .npy files and .npz archives of them, read whole and strictly (errors name the
// file, the array and the reason); .npy written as numpy writes it (the tests' and tools' data).
//
typedef enum { AT_F32, AT_F64, AT_BF16, AT_I8, AT_U8, AT_I16, AT_U16, AT_I32, AT_I64, AT_BOOL } ArrayType;
typedef struct {
  char *name, *file; // the array's name, and the file it came from
  ArrayType type;
  Shape shape;
  void *data; // malloc'd, little-endian elements in C order
} NpArray;
const char *array_type_name(ArrayType t); // numpy's name: "float32", "int64", ...
int array_type_size(ArrayType t);
// A .npy file's array, named `name`; false after printing "path: error: array 'name': reason".
bool npy_read(const char *path, const char *name, NpArray *out);
// The arrays of an .npz archive (stored entries: np.savez, not np.savez_compressed), named as its
// entries less ".npy"; the count, or -1 after printing why.
int npz_read(const char *path, NpArray **out);
bool npy_write(const char *path, ArrayType type, Shape shape, const void *data); // atomically
void np_array_free(NpArray *a);

//
// arrays.c: datasets of named arrays, one per model input, their first axis the examples: .npy,
// .npz and .safetensors files, as a folder or a single file. The train split is the folder's files
// (or DIR/train/'s, or the single file), the val split DIR/val/'s files or DIR/val.npz /
// DIR/val.safetensors, else a fixed share of the examples (LoaderOptions.val_fraction). Every
// input's array is checked against its declaration (dtype, the shape of one example) before anything
// is compiled; the arrays are read into memory, converted to the input's i32 or f32.
//
// Whether path is an array dataset: such a file, or a folder holding some (itself or in train/)
// and no token shards.
bool arrays_found(const char *path);
// What `mdlc run` checks before compiling: both splits of the dataset at path against g's inputs.
// False after saying why (the file, the array, the reason; or the input that no array fills).
bool arrays_check(const char *path, const Graph *g, double val_fraction);
// The loader of one split (loader.c hands its calls over to these when LoaderOptions.model is set).
typedef struct ArrayLoader ArrayLoader;
ArrayLoader *arrays_loader_open(const char *path, const char *split, LoaderOptions o);
void arrays_loader_next(ArrayLoader *l, Batch *b);
LoaderState arrays_loader_state(const ArrayLoader *l);
bool arrays_loader_seek(ArrayLoader *l, LoaderState s);
int64_t arrays_loader_rows(const ArrayLoader *l); // examples in the split
void arrays_loader_close(ArrayLoader *l);
#endif
