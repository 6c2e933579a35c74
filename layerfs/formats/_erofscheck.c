/* The structural check of a meta image, compiled: the same rules as
 * layerfs/formats/erofscheck.py (its module docstring lists them), one verdict.
 *
 * check(image, blob_size, chunk_size) returns (inodes, dirs, regular,
 * chunk_indexes, blocks) for an image the rules accept and None for one they
 * refuse; the Python checker then names the first problem. Every read of the
 * image goes through rd16/rd32/rd64 after a bounds check against the image
 * length; every offset is a uint64_t computed from values already bounded by
 * it, so nothing wraps. Tables are sized by the image (one slot per 32-byte
 * nid, one bit per inode number and per shared xattr id); a table that cannot
 * grow is MemoryError, never a verdict. The GIL is released while the check
 * runs, so the image must be a read-only buffer (it cannot change meanwhile),
 * and the sizes must be integers in [0, 2^64) (OverflowError otherwise).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 4096u
#define BLKBITS 12
#define MAGIC 0xE0F5E1E2u
#define SB_OFFSET 1024u
#define RESERVED_AREA (SB_OFFSET + 128u + 128u)
#define COMPACT_SIZE 32u
#define EXTENDED_SIZE 64u
#define DIRENT_SIZE 12u
#define NULL_ADDR 0xFFFFFFFFu
#define COMPAT_SB_CHKSUM 0x1u
#define KNOWN_COMPAT 0x3u
#define WANTED_INCOMPAT 0xCu
#define LAYOUT_FLAT_PLAIN 0u
#define LAYOUT_FLAT_INLINE 2u
#define LAYOUT_CHUNK_BASED 4u
#define CHUNK_FORMAT_INDEXES 0x20u
#define CHUNK_BLKBITS_MASK 0x1Fu
#define MAX_NAME 255u
#define MAX_SYMLINK (BLOCK - 1u)

#define S_FMT 0170000u
#define S_REG 0100000u
#define S_DIR 0040000u
#define S_LNK 0120000u
#define S_CHR 0020000u
#define S_BLK 0060000u
#define S_FIFO 0010000u
#define S_SOCK 0140000u

typedef struct {
    uint64_t nid, pos, size, body;
    uint32_t mode, fmt, layout, i_u, nlink, isize, xattr_size;
} Inode;

typedef struct {
    uint64_t start, end;
} Region;

typedef struct {
    const uint8_t *name;
    uint32_t len;
    uint64_t nid;
    uint32_t ftype;
} Dirent;

typedef struct {
    const uint8_t *img;
    uint64_t len;
    uint64_t blob_blocks, chunk_size;
    /* superblock */
    uint64_t root_nid, inos, blocks, xattr_blkaddr, dev_blocks;
    /* per nid (len / 32 slots): index + 1 of its Inode in ``nodes``, 0 if unseen */
    uint32_t *slot;
    uint64_t nslots;
    Inode *nodes;
    uint64_t *links;
    uint64_t nnodes, cap_nodes;
    uint8_t *ino_seen, *xid_seen;
    Region *regions;
    uint64_t nregions, cap_regions;
    Dirent *ents;
    uint64_t nents, cap_ents;
    uint64_t chunk_indexes, dirs, regular;
    int out_of_memory; /* a table could not grow: MemoryError, not a verdict */
} Checker;

static uint32_t CRC_TABLE[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        CRC_TABLE[i] = c;
    }
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }

static int all_zero(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

static int bit_test_set(uint8_t *bits, uint64_t i) {
    int was = (bits[i >> 3] >> (i & 7)) & 1;
    bits[i >> 3] |= (uint8_t)(1u << (i & 7));
    return was;
}

/* Grow *arr (of *cap items of ``size`` bytes) to hold one more; 0 if out of
 * memory (noted in ``c``, so that it is not taken for a refusal). */
static int grow(Checker *c, void **arr, uint64_t *cap, uint64_t n, size_t size) {
    if (n < *cap) return 1;
    uint64_t ncap = *cap ? *cap * 2 : 64;
    void *p = realloc(*arr, ncap * size);
    if (!p) {
        c->out_of_memory = 1;
        return 0;
    }
    *arr = p;
    *cap = ncap;
    return 1;
}

static int region(Checker *c, uint64_t start, uint64_t end) {
    if (!grow(c, (void **)&c->regions, &c->cap_regions, c->nregions, sizeof(Region))) return 0;
    c->regions[c->nregions].start = start;
    c->regions[c->nregions].end = end;
    c->nregions++;
    return 1;
}

static int file_type(uint32_t fmt) {
    switch (fmt) {
    case S_REG: return 1;
    case S_DIR: return 2;
    case S_CHR: return 3;
    case S_BLK: return 4;
    case S_FIFO: return 5;
    case S_SOCK: return 6;
    case S_LNK: return 7;
    default: return 0;
    }
}

/* -- superblock and device table -- */

static int superblock(Checker *c) {
    const uint8_t *img = c->img, *sb = img + SB_OFFSET;
    if (c->len < BLOCK || c->len % BLOCK) return 0;
    if (rd32(sb) != MAGIC) return 0;
    uint32_t compat = rd32(sb + 8);
    if ((compat & ~KNOWN_COMPAT) || !(compat & COMPAT_SB_CHKSUM)) return 0;
    uint32_t crc = 0xFFFFFFFFu;
    for (uint32_t i = SB_OFFSET; i < BLOCK; i++) {
        uint8_t byte = (i >= SB_OFFSET + 4 && i < SB_OFFSET + 8) ? 0 : img[i];
        crc = CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8);
    }
    if (crc != rd32(sb + 4)) return 0;
    if (rd32(sb + 80) != WANTED_INCOMPAT) return 0;
    if (sb[12] != BLKBITS || sb[13] || rd16(sb + 84) || rd32(sb + 40)) return 0;
    if (!all_zero(sb + 90, 38) || rd32(sb + 32) >= 1000000000u) return 0;
    c->root_nid = rd16(sb + 14);
    c->inos = rd64(sb + 16);
    c->blocks = rd32(sb + 36);
    c->xattr_blkaddr = rd32(sb + 44);
    if (c->blocks * BLOCK != c->len) return 0;
    if (c->xattr_blkaddr >= c->blocks || c->inos == 0 || c->inos > c->len / COMPACT_SIZE)
        return 0;
    uint32_t slotoff = rd16(sb + 88);
    if (rd16(sb + 86) != 1 || (uint64_t)slotoff * 128 != SB_OFFSET + 128) return 0;
    const uint8_t *slot = img + (uint64_t)slotoff * 128;
    if (rd32(slot + 68) || !all_zero(slot + 72, 56)) return 0;
    c->dev_blocks = rd32(slot + 64);
    if (c->dev_blocks > c->blob_blocks) return 0;
    return 1;
}

/* -- xattrs -- */

/* The xattr entry at ``pos`` (ending by ``limit``): its end in *end; 0 if bad. */
static int xattr_entry(Checker *c, uint64_t pos, uint64_t limit, uint64_t *end) {
    if (pos + 4 > limit || limit > c->len) return 0;
    uint32_t name_len = c->img[pos], index = c->img[pos + 1], value_size = rd16(c->img + pos + 2);
    int acl = index == 2 || index == 3;
    if (!(index == 1 || acl || index == 4 || index == 6) || (name_len == 0) != acl) return 0;
    *end = pos + 4 + ceil_div(name_len + value_size, 4) * 4;
    if (*end > limit) return 0;
    if (memchr(c->img + pos + 4, 0, name_len)) return 0;
    return 1;
}

static int shared_xattr(Checker *c, uint64_t xid) {
    if (!c->xattr_blkaddr) return 0;
    uint64_t pos = c->xattr_blkaddr * BLOCK + 4 * xid, end;
    if (pos + 4 > c->len) return 0;
    /* pos + 4 <= len bounds xid below len / 4: the bitmap's size */
    if (bit_test_set(c->xid_seen, xid)) return 1;
    if (!xattr_entry(c, pos, c->len, &end)) return 0;
    return region(c, pos, end);
}

static int xattrs(Checker *c, const Inode *n) {
    uint64_t start = n->pos + n->isize;
    if (start + 12 > n->body) return 0;
    const uint8_t *head = c->img + start;
    if (rd32(head) || !all_zero(head + 5, 7)) return 0;
    uint32_t shared = head[4];
    uint64_t pos = start + 12 + 4 * (uint64_t)shared;
    if (pos > n->body) return 0;
    for (uint32_t k = 0; k < shared; k++)
        if (!shared_xattr(c, rd32(c->img + start + 12 + 4 * (uint64_t)k))) return 0;
    while (pos < n->body)
        if (!xattr_entry(c, pos, n->body, &pos)) return 0;
    return 1;
}

/* -- data of one inode -- */

/* Start and length of block ``i`` of a flat inode's data (the last maybe inline). */
static void piece(const Inode *n, uint64_t i, uint64_t nblocks, uint64_t *start, uint64_t *len) {
    uint64_t rest = n->size - i * BLOCK;
    *len = rest < BLOCK ? rest : BLOCK;
    if (n->layout == LAYOUT_FLAT_INLINE && i == nblocks - 1)
        *start = n->body;
    else
        *start = ((uint64_t)n->i_u + i) * BLOCK;
}

static int flat(Checker *c, const Inode *n) {
    uint64_t nblocks = ceil_div(n->size, BLOCK);
    if (n->layout == LAYOUT_FLAT_INLINE) {
        if (n->size == 0) return 0;
        uint64_t tail = n->size - (nblocks - 1) * BLOCK;
        if (n->body % BLOCK + tail > BLOCK || n->body + tail > c->len) return 0;
        if (!region(c, n->pos, n->body + tail)) return 0;
        nblocks--;
    } else if (!region(c, n->pos, n->body)) {
        return 0;
    }
    if (nblocks) {
        if (n->i_u == 0 || n->i_u + nblocks > c->blocks) return 0;
        return region(c, (uint64_t)n->i_u * BLOCK, ((uint64_t)n->i_u + nblocks) * BLOCK);
    }
    return !(n->layout == LAYOUT_FLAT_PLAIN && n->i_u);
}

static int chunks(Checker *c, const Inode *n) {
    uint32_t fmt = n->i_u;
    uint32_t chunk_bits = BLKBITS + (fmt & CHUNK_BLKBITS_MASK);
    if ((fmt & ~(CHUNK_BLKBITS_MASK | CHUNK_FORMAT_INDEXES)) || !(fmt & CHUNK_FORMAT_INDEXES))
        return 0;
    if ((1ull << chunk_bits) != c->chunk_size) return 0;
    uint64_t count = ceil_div(n->size, c->chunk_size);
    uint64_t start = ceil_div(n->body, 8) * 8;
    if (count > c->len / 8) return 0; /* past the image end in any case */
    uint64_t end = start + 8 * count;
    if (end > c->len) return 0;
    if (!region(c, n->pos, end > n->body ? end : n->body)) return 0;
    uint64_t chunk_blocks = c->chunk_size / BLOCK;
    for (uint64_t i = 0; i < count; i++) {
        const uint8_t *e = c->img + start + 8 * i;
        uint32_t advise = rd16(e), device = rd16(e + 2), blkaddr = rd32(e + 4);
        if (advise) return 0;
        if (blkaddr == NULL_ADDR) {
            if (device) return 0;
            continue;
        }
        uint64_t length = ceil_div(n->size - i * c->chunk_size, BLOCK);
        if (length > chunk_blocks) length = chunk_blocks;
        if (device != 1 || blkaddr + length > c->dev_blocks) return 0;
    }
    c->chunk_indexes += count;
    return 1;
}

static int data(Checker *c, const Inode *n) {
    uint32_t fmt = n->fmt;
    if (fmt == S_REG && n->layout == LAYOUT_CHUNK_BASED) return chunks(c, n);
    if (fmt == S_REG || fmt == S_DIR || fmt == S_LNK) {
        if (n->layout != LAYOUT_FLAT_PLAIN && n->layout != LAYOUT_FLAT_INLINE) return 0;
        if (fmt == S_DIR && n->size == 0) return 0;
        if (fmt == S_LNK && !(n->size > 0 && n->size <= MAX_SYMLINK)) return 0;
        if (fmt == S_REG && n->size && n->layout != LAYOUT_FLAT_INLINE) return 0;
        if (fmt == S_REG && n->size >= BLOCK) return 0;
        if (!flat(c, n)) return 0;
        if (fmt == S_LNK) {
            uint64_t nblocks = ceil_div(n->size, BLOCK), start, len;
            for (uint64_t i = 0; i < nblocks; i++) {
                piece(n, i, nblocks, &start, &len);
                if (memchr(c->img + start, 0, len)) return 0;
            }
        }
        return 1;
    }
    if (n->size || n->layout != LAYOUT_FLAT_PLAIN) return 0;
    if ((fmt == S_FIFO || fmt == S_SOCK) && n->i_u) return 0;
    return region(c, n->pos, n->body);
}

/* -- one inode: its index in ``nodes`` + 1, or 0 if bad -- */

static uint64_t inode(Checker *c, uint64_t nid) {
    if (nid < RESERVED_AREA / 32 || nid >= c->nslots) return 0; /* nslots = len / 32 */
    Inode n;
    memset(&n, 0, sizeof n);
    n.nid = nid;
    n.pos = nid * 32;
    const uint8_t *p = c->img + n.pos;
    uint32_t i_format = rd16(p), icount = rd16(p + 2), ino;
    if (i_format & ~0xFu) return 0;
    n.layout = i_format >> 1;
    n.mode = rd16(p + 4);
    if (i_format & 1) {
        if (n.pos + EXTENDED_SIZE > c->len) return 0;
        if (rd16(p + 6) || !all_zero(p + 48, 16) || rd32(p + 40) >= 1000000000u) return 0;
        n.size = rd64(p + 8);
        n.i_u = rd32(p + 16);
        ino = rd32(p + 20);
        n.nlink = rd32(p + 44);
        n.isize = EXTENDED_SIZE;
    } else {
        if (rd32(p + 12) || rd32(p + 28)) return 0;
        n.nlink = rd16(p + 6);
        n.size = rd32(p + 8);
        n.i_u = rd32(p + 16);
        ino = rd32(p + 20);
        n.isize = COMPACT_SIZE;
    }
    n.xattr_size = icount == 0 ? 0 : 12 + 4 * (icount - 1);
    n.fmt = n.mode & S_FMT;
    n.body = n.pos + n.isize + n.xattr_size;
    if (n.pos % BLOCK + n.isize + n.xattr_size > BLOCK) return 0;
    if (ino == 0 || ino > c->inos || bit_test_set(c->ino_seen, ino)) return 0;
    if (n.nlink == 0) return 0;
    if (!file_type(n.fmt)) return 0;
    if (n.xattr_size && !xattrs(c, &n)) return 0;
    if (!data(c, &n)) return 0;
    if (!grow(c, (void **)&c->nodes, &c->cap_nodes, c->nnodes, sizeof(Inode))) return 0;
    c->nodes[c->nnodes++] = n;
    c->slot[nid] = (uint32_t)c->nnodes;
    return c->nnodes;
}

/* -- directories -- */

static int dirent_add(Checker *c, const uint8_t *name, uint64_t len, uint64_t nid, uint32_t ftype) {
    if (!grow(c, (void **)&c->ents, &c->cap_ents, c->nents, sizeof(Dirent))) return 0;
    Dirent *d = &c->ents[c->nents++];
    d->name = name;
    d->len = (uint32_t)len;
    d->nid = nid;
    d->ftype = ftype;
    return 1;
}

/* The entries of one directory block (``size`` bytes at ``block``) appended to ents. */
static int dir_block(Checker *c, const uint8_t *block, uint64_t size) {
    if (size < DIRENT_SIZE) return 0;
    uint32_t first = rd16(block + 8);
    if (first % DIRENT_SIZE || !(DIRENT_SIZE <= first && first < size)) return 0;
    uint32_t count = first / DIRENT_SIZE;
    for (uint32_t k = 0; k < count; k++) {
        const uint8_t *h = block + (uint64_t)k * DIRENT_SIZE;
        uint64_t nameoff = rd16(h + 8);
        uint64_t end = k + 1 < count ? rd16(h + DIRENT_SIZE + 8) : size;
        if (!(first <= nameoff && nameoff < end && end <= size) || h[11]) return 0;
        const uint8_t *name = block + nameoff;
        uint64_t len = end - nameoff;
        if (k + 1 == count) {
            const uint8_t *nul = memchr(name, 0, len);
            if (nul) len = (uint64_t)(nul - name);
        }
        if (len == 0 || len > MAX_NAME || memchr(name, '/', len) || memchr(name, 0, len))
            return 0;
        if (h[10] < 1 || h[10] > 7) return 0;
        if (!dirent_add(c, name, len, rd64(h), h[10])) return 0;
    }
    return 1;
}

static int name_cmp(const Dirent *a, const Dirent *b) {
    uint32_t n = a->len < b->len ? a->len : b->len;
    int r = memcmp(a->name, b->name, n);
    if (r) return r;
    return (a->len > b->len) - (a->len < b->len);
}

static int is_dot(const Dirent *d) { return d->len == 1 && d->name[0] == '.'; }
static int is_dotdot(const Dirent *d) { return d->len == 2 && d->name[0] == '.' && d->name[1] == '.'; }

/* Every entry of directory ``n`` into ents, checked and sorted. */
static int dirents(Checker *c, const Inode *n) {
    c->nents = 0;
    uint64_t nblocks = ceil_div(n->size, BLOCK), start, len;
    for (uint64_t i = 0; i < nblocks; i++) {
        piece(n, i, nblocks, &start, &len);
        if (start + len > c->len || !dir_block(c, c->img + start, len)) return 0;
    }
    int dot = 0, dotdot = 0;
    for (uint64_t i = 0; i < c->nents; i++) {
        if (i && name_cmp(&c->ents[i - 1], &c->ents[i]) >= 0) return 0;
        dot |= is_dot(&c->ents[i]);
        dotdot |= is_dotdot(&c->ents[i]);
    }
    return dot && dotdot;
}

/* -- the tree: breadth first from the root -- */

static int walk(Checker *c) {
    uint64_t root = inode(c, c->root_nid);
    if (!root || c->nodes[root - 1].fmt != S_DIR) return 0;
    /* the queue: indexes into nodes of directories, with their parents' nids */
    uint64_t *queue = NULL, *parents = NULL, qcap = 0, qlen = 0, qhead = 0;
    int ok = 0;
    queue = malloc(sizeof(uint64_t) * 64);
    parents = malloc(sizeof(uint64_t) * 64);
    if (!queue || !parents) {
        c->out_of_memory = 1;
        goto out;
    }
    qcap = 64;
    queue[qlen] = root - 1;
    parents[qlen++] = c->root_nid;
    while (qhead < qlen) {
        uint64_t idx = queue[qhead], parent = parents[qhead];
        qhead++;
        Inode node = c->nodes[idx];
        c->dirs++;
        if (!dirents(c, &node)) goto out;
        uint64_t subdirs = 0;
        for (uint64_t i = 0; i < c->nents; i++) {
            const Dirent *d = &c->ents[i];
            if (is_dot(d) || is_dotdot(d)) {
                if (d->nid != (is_dot(d) ? node.nid : parent)) goto out;
                continue;
            }
            if (d->nid >= c->nslots) goto out;
            uint64_t child = c->slot[d->nid];
            if (child == 0) {
                child = inode(c, d->nid);
                if (!child) goto out;
                uint32_t fmt = c->nodes[child - 1].fmt;
                if (fmt == S_DIR) {
                    if (qlen == qcap) {
                        uint64_t *q2 = realloc(queue, sizeof(uint64_t) * qcap * 2);
                        if (q2) queue = q2;
                        uint64_t *p2 = q2 ? realloc(parents, sizeof(uint64_t) * qcap * 2) : NULL;
                        if (!p2) {
                            c->out_of_memory = 1;
                            goto out;
                        }
                        parents = p2;
                        qcap *= 2;
                    }
                    queue[qlen] = child - 1;
                    parents[qlen++] = node.nid;
                } else if (fmt == S_REG) {
                    c->regular++;
                }
            } else if (c->nodes[child - 1].fmt == S_DIR) {
                goto out; /* a directory reached twice */
            }
            const Inode *ch = &c->nodes[child - 1];
            if ((uint32_t)file_type(ch->fmt) != d->ftype) goto out;
            c->links[d->nid]++;
            subdirs += ch->fmt == S_DIR;
        }
        if (node.nlink != 2 + subdirs) goto out;
    }
    for (uint64_t i = 0; i < c->nnodes; i++) {
        const Inode *n = &c->nodes[i];
        if (n->fmt != S_DIR && c->links[n->nid] && n->nlink != c->links[n->nid]) goto out;
    }
    ok = 1;
out:
    free(queue);
    free(parents);
    return ok;
}

static int region_cmp(const void *a, const void *b) {
    const Region *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static int no_overlaps(Checker *c) {
    qsort(c->regions, c->nregions, sizeof(Region), region_cmp);
    for (uint64_t i = 1; i < c->nregions; i++)
        if (c->regions[i].start < c->regions[i - 1].end) return 0;
    return 1;
}

/* 1 accepted, 0 refused, -1 out of memory (or an image too large for the tables). */
static int run(Checker *c) {
    if (!superblock(c)) return 0;
    c->nslots = c->len / 32;
    if (c->nslots >= UINT32_MAX) return -1; /* ``slot`` holds inode indexes as uint32_t */
    c->slot = calloc(c->nslots, sizeof(uint32_t));
    c->links = calloc(c->nslots, sizeof(uint64_t));
    c->ino_seen = calloc(c->inos / 8 + 1, 1);
    c->xid_seen = calloc(c->len / 32 + 1, 1);
    if (!c->slot || !c->links || !c->ino_seen || !c->xid_seen) return -1;
    if (!region(c, 0, RESERVED_AREA)) return -1;
    int walked = walk(c);
    if (c->out_of_memory) return -1;
    if (!walked || c->nnodes != c->inos) return 0;
    return no_overlaps(c);
}

static void release(Checker *c) {
    free(c->slot);
    free(c->links);
    free(c->ino_seen);
    free(c->xid_seen);
    free(c->nodes);
    free(c->regions);
    free(c->ents);
}

static PyObject *check(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *blob_obj, *chunk_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!O!", &buf, &PyLong_Type, &blob_obj, &PyLong_Type, &chunk_obj))
        return NULL;
    /* sizes outside [0, 2^64) raise OverflowError (never reduced modulo 2^64) */
    unsigned long long blob_size = PyLong_AsUnsignedLongLong(blob_obj);
    unsigned long long chunk_size = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(chunk_obj);
    if (!PyErr_Occurred() && !buf.readonly) /* it must not change while the GIL is released */
        PyErr_SetString(PyExc_TypeError, "the image must be a read-only buffer");
    if (PyErr_Occurred()) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    Checker c;
    memset(&c, 0, sizeof c);
    c.img = buf.buf;
    c.len = (uint64_t)buf.len;
    c.blob_blocks = ceil_div(blob_size, BLOCK);
    c.chunk_size = chunk_size;
    int verdict;
    Py_BEGIN_ALLOW_THREADS
    verdict = run(&c);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    PyObject *out;
    if (verdict < 0)
        out = PyErr_NoMemory();
    else if (verdict == 0)
        out = Py_NewRef(Py_None);
    else
        out = Py_BuildValue("(KKKKK)", (unsigned long long)c.nnodes, (unsigned long long)c.dirs,
                            (unsigned long long)c.regular, (unsigned long long)c.chunk_indexes,
                            (unsigned long long)c.blocks);
    release(&c);
    return out;
}

static PyMethodDef METHODS[] = {
    {"check", check, METH_VARARGS,
     "check(image, blob_size, chunk_size) -> (inodes, dirs, regular, chunk_indexes, blocks) "
     "if the image passes the structural check, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_erofscheck",
    "The structural check of a meta image, compiled (one verdict; erofscheck names problems).",
    -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__erofscheck(void) {
    crc_init();
    return PyModule_Create(&MODULE);
}
