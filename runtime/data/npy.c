// npy.c: numpy's files, read whole and strictly. A .npy file is the magic "\x93NUMPY", a version
// (1.0, 2.0 or 3.0), the length of a header (2 bytes little-endian in 1.0, 4 after), the header (a
// Python dict literal: {'descr': '<f4', 'fortran_order': False, 'shape': (100, 16), }, padded with
// spaces to a newline), then the elements in C order. A .npz file is a zip archive of .npy files,
// one per array, named NAME.npy; np.savez stores them, np.savez_compressed deflates them, which this
// reader refuses (mdl does not link zlib). Each entry's CRC-32 is checked. Anything else (a big-endian
// or structured dtype, Fortran order, bytes after the data, a zip64 archive) is refused with the
// file, the array and the reason named.
#include "data.h"
#include "rt_util.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static const struct {
  const char *descr, *name; // the dtype as .npy and safetensors write it, and as numpy names it
  ArrayType type;
  int size;
} types[] = {{"f4", "float32", AT_F32, 4}, {"f8", "float64", AT_F64, 8}, {"i1", "int8", AT_I8, 1},
             {"u1", "uint8", AT_U8, 1},    {"i2", "int16", AT_I16, 2},   {"u2", "uint16", AT_U16, 2},
             {"i4", "int32", AT_I32, 4},   {"i8", "int64", AT_I64, 8},   {"b1", "bool", AT_BOOL, 1},
             {"", "bfloat16", AT_BF16, 2}};

const char *array_type_name(ArrayType t) {
  for (size_t i = 0; i < sizeof types / sizeof *types; i++)
    if (types[i].type == t)
      return types[i].name;
  return "?";
}

int array_type_size(ArrayType t) {
  for (size_t i = 0; i < sizeof types / sizeof *types; i++)
    if (types[i].type == t)
      return types[i].size;
  return 0;
}

void np_array_free(NpArray *a) {
  free(a->name);
  free(a->file);
  free(a->data);
  *a = (NpArray){0};
}

// The file's whole contents (malloc'd); NULL after printing why.
static unsigned char *read_all(const char *path, size_t *n) {
  char why[256];
  unsigned char *buf = (unsigned char *)file_read(path, n, 0, why, sizeof why);
  if (!buf)
    diag_file_error(path, "%s", why);
  return buf;
}

// The header dict, parsed by hand: the three keys numpy writes, each once, nothing else.
typedef struct {
  const char *s, *end;
} Cursor;

static void skip_space(Cursor *c) {
  while (c->s < c->end && (*c->s == ' ' || *c->s == '\n' || *c->s == '\t'))
    c->s++;
}

static bool eat(Cursor *c, char ch) {
  skip_space(c);
  if (c->s < c->end && *c->s == ch) {
    c->s++;
    return true;
  }
  return false;
}

// A quoted string ('...' or "...") into buf.
static bool quoted(Cursor *c, char *buf, size_t n) {
  skip_space(c);
  if (c->s >= c->end || (*c->s != '\'' && *c->s != '"'))
    return false;
  char q = *c->s++;
  size_t k = 0;
  while (c->s < c->end && *c->s != q && k + 1 < n)
    buf[k++] = *c->s++;
  buf[k] = 0;
  return c->s < c->end && *c->s++ == q;
}

static bool parse_header(Cursor *c, char *descr, size_t ndescr, bool *fortran, Shape *shape, char *why, size_t nwhy) {
  bool seen[3] = {false, false, false};
  if (!eat(c, '{'))
    return rt_fail(why, nwhy, "the header is not a dict");
  while (!eat(c, '}')) {
    char key[32];
    if (!quoted(c, key, sizeof key) || !eat(c, ':'))
      return rt_fail(why, nwhy, "the header is not a dict of 'descr', 'fortran_order' and 'shape'");
    if (!strcmp(key, "descr")) {
      if (!quoted(c, descr, ndescr))
        return rt_fail(why, nwhy, "'descr' is not a string: structured dtypes are not supported");
      seen[0] = true;
    } else if (!strcmp(key, "fortran_order")) {
      skip_space(c);
      size_t left = (size_t)(c->end - c->s);
      if (left >= 4 && !strncmp(c->s, "True", 4))
        *fortran = true, c->s += 4;
      else if (left >= 5 && !strncmp(c->s, "False", 5))
        *fortran = false, c->s += 5;
      else
        return rt_fail(why, nwhy, "'fortran_order' is neither True nor False");
      seen[1] = true;
    } else if (!strcmp(key, "shape")) {
      if (!eat(c, '('))
        return rt_fail(why, nwhy, "'shape' is not a tuple");
      shape->rank = 0;
      while (!eat(c, ')')) {
        skip_space(c);
        int64_t d = 0;
        const char *digits = c->s;
        for (; c->s < c->end && *c->s >= '0' && *c->s <= '9'; c->s++)
          if ((d = 10 * d + (*c->s - '0')) > IR_MAX_NUMEL)
            return rt_fail(why, nwhy, "an axis of more than %lld elements", (long long)IR_MAX_NUMEL);
        if (c->s == digits)
          return rt_fail(why, nwhy, "'shape' holds something other than sizes");
        if (shape->rank == IR_MAX_RANK)
          return rt_fail(why, nwhy, "more than %d axes", IR_MAX_RANK);
        shape->d[shape->rank++] = d;
        if (!eat(c, ',') && !(skip_space(c), c->s < c->end && *c->s == ')'))
          return rt_fail(why, nwhy, "'shape' is not a tuple of sizes");
      }
      seen[2] = true;
    } else {
      return rt_fail(why, nwhy, "unknown header key '%s'", key);
    }
    if (!eat(c, ',') && !(skip_space(c), c->s < c->end && *c->s == '}'))
      return rt_fail(why, nwhy, "the header dict is malformed");
  }
  if (!seen[0] || !seen[1] || !seen[2])
    return rt_fail(why, nwhy, "the header lacks '%s'", !seen[0] ? "descr" : !seen[1] ? "fortran_order" : "shape");
  return true;
}

// A .npy image buf[0, n) into *out (its data copied); false with the reason in why.
static bool parse_npy(const unsigned char *buf, size_t n, NpArray *out, char *why, size_t nwhy) {
  if (n < 10 || memcmp(buf, "\x93NUMPY", 6))
    return rt_fail(why, nwhy, "not a .npy file (no \\x93NUMPY magic)");
  int major = buf[6];
  if (major < 1 || major > 3)
    return rt_fail(why, nwhy, ".npy format version %d.%d is not supported (1.0 to 3.0 are)", major, buf[7]);
  size_t hlen, start;
  if (major == 1) {
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8;
    start = 10;
  } else {
    if (n < 12)
      return rt_fail(why, nwhy, "truncated header");
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    start = 12;
  }
  if (hlen > n - start)
    return rt_fail(why, nwhy, "truncated header (%zu bytes said, %zu there)", hlen, n - start);
  char descr[32];
  bool fortran = false;
  Shape shape = {0};
  Cursor c = {(const char *)buf + start, (const char *)buf + start + hlen};
  if (!parse_header(&c, descr, sizeof descr, &fortran, &shape, why, nwhy))
    return false;
  if (fortran)
    return rt_fail(why, nwhy, "Fortran order (fortran_order: True): save it in C order (np.ascontiguousarray)");
  char order = descr[0];
  const char *code = descr + (order == '<' || order == '>' || order == '|' || order == '=');
  int t = -1;
  for (size_t i = 0; i < sizeof types / sizeof *types; i++)
    if (types[i].descr[0] && !strcmp(code, types[i].descr))
      t = (int)i;
  if (t < 0)
    return rt_fail(why, nwhy, "dtype '%s' is not supported (float32, float64, int8 to int64, uint8, uint16, bool are)",
                   descr);
  if (order == '>' && types[t].size > 1)
    return rt_fail(why, nwhy, "big-endian dtype '%s': save it little-endian (x.astype('<%s'))", descr, code);
  int64_t numel = 1;
  for (int i = 0; i < shape.rank; i++) {
    if (shape.d[i] > 0 && numel > IR_MAX_NUMEL / shape.d[i])
      return rt_fail(why, nwhy, "more than %lld elements", (long long)IR_MAX_NUMEL);
    numel *= shape.d[i];
  }
  size_t bytes = (size_t)numel * (size_t)types[t].size, have = n - start - hlen;
  if (have != bytes)
    return rt_fail(why, nwhy, "%s: the shape %s wants %zu bytes of data, the file holds %zu", have < bytes ?
                   "truncated" : "bytes after the data", shape_str(shape, (char[96]){0}, 96), bytes, have);
  void *data = malloc(bytes ? bytes : 1);
  if (!data)
    return rt_fail(why, nwhy, "out of memory (%zu bytes)", bytes);
  memcpy(data, buf + start + hlen, bytes);
  *out = (NpArray){.type = types[t].type, .shape = shape, .data = data};
  return true;
}

bool npy_read(const char *path, const char *name, NpArray *out) {
  size_t n;
  unsigned char *buf = read_all(path, &n);
  if (!buf)
    return false;
  char why[256];
  bool ok = parse_npy(buf, n, out, why, sizeof why);
  free(buf);
  if (!ok) {
    diag_file_error(path, "array '%s': %s", name, why);
    return false;
  }
  out->name = xstrdup(name, "an array's name");
  out->file = xstrdup(path, "an array's name");
  return true;
}

static uint32_t crc32(const unsigned char *p, size_t n) {
  static uint32_t table[256];
  if (!table[1])
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++)
        c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; i++)
    c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

static uint32_t le16(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t le32(const unsigned char *p) { return le16(p) | le16(p + 2) << 16; }
static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

// One central directory entry's sizes and offset, with a zip64 extra field's where the 32-bit ones
// are 0xFFFFFFFF (np.savez writes its entries with force_zip64).
static void zip64_sizes(const unsigned char *extra, size_t n, uint64_t *usize, uint64_t *csize, uint64_t *off) {
  for (size_t i = 0; i + 4 <= n;) {
    uint32_t id = le16(extra + i), len = le16(extra + i + 2);
    const unsigned char *p = extra + i + 4, *end = p + len;
    if (id == 1 && i + 4 + len <= n) {
      uint64_t *fields[3] = {usize, csize, off};
      for (int k = 0; k < 3; k++)
        if (*fields[k] == 0xFFFFFFFFu && p + 8 <= end) {
          *fields[k] = le64(p);
          p += 8;
        }
    }
    i += 4 + len;
  }
}

int npz_read(const char *path, NpArray **out) {
  size_t n;
  *out = NULL;
  unsigned char *buf = read_all(path, &n);
  if (!buf)
    return -1;
  int count = 0, nent = 0;
  uint64_t stored = 0; // bytes of the entries read so far
  char why[256] = "";
  const char *entry = NULL;
  char name[256] = "";
  // The end of central directory record: its signature, searched from the end (a comment may follow).
  size_t eocd = n >= 22 ? n - 22 : 0;
  bool found = false;
  for (size_t k = 0; n >= 22 && k <= 65535 + 22 && !found; k++) {
    if (le32(buf + eocd) == 0x06054b50)
      found = true;
    else if (eocd-- == 0)
      break;
  }
  if (!found) {
    rt_fail(why, sizeof why, "not a zip archive (an .npz is one: np.savez writes it)");
    goto fail;
  }
  nent = (int)le16(buf + eocd + 10);
  uint64_t cd = le32(buf + eocd + 16);
  if (cd == 0xFFFFFFFFu || nent == 0xFFFF) {
    rt_fail(why, sizeof why, "a zip64 archive (over 4 GB or 65535 arrays): save the arrays as .npy files instead");
    goto fail;
  }
  *out = xcalloc((size_t)(nent ? nent : 1), sizeof **out, "the zip's entries");
  for (int e = 0; e < nent; e++) {
    if (cd + 46 > n || le32(buf + cd) != 0x02014b50) {
      rt_fail(why, sizeof why, "the zip's central directory is damaged");
      goto fail;
    }
    uint32_t method = le16(buf + cd + 10), crc = le32(buf + cd + 16), nlen = le16(buf + cd + 28),
             xlen = le16(buf + cd + 30), clen = le16(buf + cd + 32);
    uint64_t csize = le32(buf + cd + 20), usize = le32(buf + cd + 24), off = le32(buf + cd + 42);
    if (cd + 46 + nlen + xlen > n) {
      rt_fail(why, sizeof why, "the zip's central directory is damaged");
      goto fail;
    }
    snprintf(name, sizeof name, "%.*s", (int)nlen, (const char *)buf + cd + 46);
    zip64_sizes(buf + cd + 46 + nlen, xlen, &usize, &csize, &off);
    cd += 46 + nlen + xlen + clen;
    entry = name;
    size_t len = strlen(name);
    if (len < 5 || strcmp(name + len - 4, ".npy")) {
      rt_fail(why, sizeof why, "not a .npy file: an .npz holds one NAME.npy per array");
      goto fail;
    }
    if (method == 8) {
      rt_fail(why, sizeof why, "compressed (np.savez_compressed): save the arrays with np.savez, which stores "
              "them uncompressed");
      goto fail;
    }
    if (method != 0 || csize != usize) {
      rt_fail(why, sizeof why, "zip compression method %u is not supported (save with np.savez)", method);
      goto fail;
    }
    if (off + 30 > n || le32(buf + off) != 0x04034b50) {
      rt_fail(why, sizeof why, "the zip's local header is damaged");
      goto fail;
    }
    uint64_t data = off + 30 + le16(buf + off + 26) + le16(buf + off + 28);
    if (data > n || usize > n - data) {
      rt_fail(why, sizeof why, "truncated (the zip says %llu bytes)", (unsigned long long)usize);
      goto fail;
    }
    if ((stored += usize) > n) { // (entries sharing bytes: reading each would take more than the file)
      rt_fail(why, sizeof why, "the zip's entries overlap: the archive is damaged");
      goto fail;
    }
    if (crc32(buf + data, usize) != crc) {
      rt_fail(why, sizeof why, "its CRC-32 does not match: the file is damaged");
      goto fail;
    }
    NpArray *a = &(*out)[count];
    if (!parse_npy(buf + data, usize, a, why, sizeof why))
      goto fail;
    count++;
    a->name = xstrndup(name, len - 4, "an array's name");
    a->file = xstrdup(path, "an array's name");
  }
  free(buf);
  return count;
fail:
  if (entry)
    diag_file_error(path, "%s: %s", entry, why);
  else
    diag_file_error(path, "%s", why);
  for (int i = 0; *out && i < count; i++)
    np_array_free(&(*out)[i]);
  free(*out);
  *out = NULL;
  free(buf);
  return -1;
}

bool npy_write(const char *path, ArrayType type, Shape shape, const void *data) {
  const char *descr = NULL;
  for (size_t i = 0; i < sizeof types / sizeof *types; i++)
    if (types[i].type == type)
      descr = types[i].descr;
  if (!descr || !descr[0]) {
    diag_file_error(path, "cannot write %s as .npy", array_type_name(type));
    return false;
  }
  char dims[160] = "";
  size_t k = 0;
  for (int i = 0; i < shape.rank; i++)
    k += (size_t)snprintf(dims + k, sizeof dims - k, "%lld,%s", (long long)shape.d[i],
                          i + 1 < shape.rank ? " " : "");
  if (shape.rank > 1) // (numpy writes (3, 4), and (3,) for one axis)
    dims[k - 1] = 0;
  char header[320];
  int len = snprintf(header, sizeof header, "{'descr': '%c%s', 'fortran_order': False, 'shape': (%s), }",
                     descr[0] == 'b' || descr[1] == '1' ? '|' : '<', descr, dims);
  int total = (10 + len + 1 + 63) / 64 * 64; // (numpy pads the header to a multiple of 64 bytes)
  memset(header + len, ' ', (size_t)(total - 10 - len - 1));
  header[total - 10 - 1] = '\n';
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(total - 10), 0};
  DataFile f;
  if (!datafile_open(&f, path))
    return false;
  size_t bytes = (size_t)shape_numel(shape) * (size_t)array_type_size(type);
  if (fwrite(pre, 1, 10, f.f) != 10 || fwrite(header, 1, (size_t)(total - 10), f.f) != (size_t)(total - 10) ||
      fwrite(data, 1, bytes, f.f) != bytes) {
    diag_file_error(path, "cannot write: %s", strerror(errno));
    datafile_abort(&f);
    return false;
  }
  return datafile_commit(&f);
}
