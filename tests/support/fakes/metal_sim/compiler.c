/* The simulated Metal compiler service (MTLCodeGenServiceCreate and
 * MTLCodeGenServiceBuildRequest of Apple's MTLCompiler framework, with tinygrad's
 * request and reply formats). It accepts a subset of the Metal Shading Language and
 * compiles it as C++ with the system compiler ($ASYNCMETAL_SIM_CXX, default c++), so the
 * "GPU" runs it on the CPU, one call per thread position:
 *
 *   kernel void NAME(PARAMS) { BODY }   any number of kernels per source
 *   device T* p [[buffer(i)]]           a buffer (const, device address space)
 *   constant T& v [[buffer(i)]]         a value set with setBytes: (or T v [[buffer(i)]]), whose
 *                                       length must cover sizeof(T) (as Metal's validation
 *                                       demands; T: an integer, bool, half, float)
 *   uint i [[thread_position_in_grid]]  the x position (no uint2/uint3)
 *   #include <metal_stdlib>, using namespace metal; metal::min/max; C++ in the body
 *   __asyncmetal_sim_fault()            a simulation-only hook: the command buffer faults
 *   __asyncmetal_sim_sleep_ms(ms)       a simulation-only hook: the thread sleeps ms
 *                                       milliseconds (MSL cannot sleep); the prelude
 *                                       defines __ASYNCMETAL_SIM__ for sources to tell
 *   __asyncmetal_sim_warning TEXT       a simulation-only marker (in a comment, say): the
 *                                       reply's warnings section has "program.metal:LINE:
 *                                       warning: TEXT" for each, as the compiler's warnings
 *
 * Not accepted: threadgroup memory and barriers, SIMD-group functions, vector types,
 * textures, other attributes. The library is "MTLB", a shared object, "ENDT"; the reply is
 * a 16-byte header whose bytes 8-16 are its size and the warnings' size, as Apple's. */
#define _GNU_SOURCE
#include <Block.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char prelude[] =
    "#pragma once\n"
    "#include <algorithm>\n"
    "#include <cmath>\n"
    "#include <cstddef>\n"
    "#include <cstdint>\n"
    "#include <type_traits>\n"
    "#include <utility>\n"
    "#include <errno.h>\n"
    "#include <time.h>\n"
    "#define __ASYNCMETAL_SIM__ 1\n"
    "#define kernel\n"
    "#define device\n"
    "#define constant const\n"
    "#define thread\n"
    "typedef unsigned int uint;\n"
    "typedef unsigned short ushort;\n"
    "typedef unsigned char uchar;\n"
    "typedef unsigned long ulong;\n"
    "typedef _Float16 half;\n"
    "namespace metal { using std::min; using std::max; }\n"
    "static thread_local int __asyncmetal_sim_faulted;\n"
    "static inline void __asyncmetal_sim_fault() { __asyncmetal_sim_faulted = 1; }\n"
    "static inline void __asyncmetal_sim_sleep_ms(int ms) {\n"
    "    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};\n"
    "    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}\n"
    "}\n"
    "template <class T> static inline T __asyncmetal_sim_arg(void **b, int i, const unsigned *g) {\n"
    "    if constexpr (std::is_pointer_v<T>) return static_cast<T>(b[i]);\n"
    "    else return *static_cast<std::remove_reference_t<T> *>(\n"
    "        i < 0 ? (void *)&g[-1 - i] : b[i]);\n"
    "}\n"
    "template <class T> constexpr int __asyncmetal_sim_size() {\n"
    "    if constexpr (std::is_pointer_v<T>) return 0;\n"
    "    else return (int)sizeof(std::remove_reference_t<T>);\n"
    "}\n"
    "template <class... P> struct __asyncmetal_sim_sizes_of {\n"
    "    static constexpr int sizes[] = {0, __asyncmetal_sim_size<P>()...};\n"
    "};\n"
    "template <class... P> static inline const int *__asyncmetal_sim_sizes(void (*)(P...)) {\n"
    "    return __asyncmetal_sim_sizes_of<P...>::sizes + 1;\n"
    "}\n"
    "template <class... P, std::size_t... I>\n"
    "static inline void __asyncmetal_sim_apply(void (*f)(P...), const int *m, void **b,\n"
    "        const unsigned *g, std::index_sequence<I...>) {\n"
    "    f(__asyncmetal_sim_arg<P>(b, m[I], g)...);\n"
    "}\n"
    "template <class... P>\n"
    "static inline int __asyncmetal_sim_run(void (*f)(P...), const int *m, void **b,\n"
    "        const unsigned *g) {\n"
    "    __asyncmetal_sim_faulted = 0;\n"
    "    __asyncmetal_sim_apply(f, m, b, g, std::index_sequence_for<P...>{});\n"
    "    return __asyncmetal_sim_faulted;\n"
    "}\n";

typedef struct { char *data; size_t len, cap; } text;

static void put(text *t, const char *s, size_t n) {
    if (t->len + n + 1 > t->cap) {
        t->cap = (t->len + n + 1) * 2;
        t->data = realloc(t->data, t->cap);
    }
    memcpy(t->data + t->len, s, n);
    t->len += n;
    t->data[t->len] = 0;
}

static void putf(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(text *t, const char *fmt, ...) {
    /* Sized first: a line longer than any fixed buffer (a long macro) is put whole. */
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n <= 0) return;
    char *buf = malloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(buf, (size_t)n + 1, fmt, ap);
    va_end(ap);
    put(t, buf, (size_t)n);
    free(buf);
}

static int is_ident(char c) { return c == '_' || (c >= '0' && c <= '9') || ((c | 32) >= 'a' && (c | 32) <= 'z'); }

/* Comments become spaces (newlines kept, so the C++ compiler's lines are the source's). */
static char *strip_comments(const char *src) {
    char *out = strdup(src);
    for (char *p = out; *p; p++) {
        if (p[0] == '/' && p[1] == '/') {
            while (*p && *p != '\n') *p++ = ' ';
            if (!*p) break;
        } else if (p[0] == '/' && p[1] == '*') {
            char *end = strstr(p + 2, "*/");
            char *stop = end ? end + 2 : p + strlen(p);
            for (; p < stop; p++)
                if (*p != '\n') *p = ' ';
            p--;
        }
    }
    return out;
}

/* Parses the kernels of `src` (comments stripped) into `wrappers`, and blanks their
 * [[attributes]] in `src`. Returns an error message or NULL. */
static char *parse_kernels(char *src, text *wrappers, int *count) {
    static char error[512];
    *count = 0;
    for (char *p = src; (p = strstr(p, "kernel"));) {
        if ((p > src && is_ident(p[-1])) || is_ident(p[6])) { p += 6; continue; }
        char *q = p + 6;
        while (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r') q++;
        if (strncmp(q, "void", 4) || is_ident(q[4])) {
            snprintf(error, sizeof error, "error: a kernel must return void");
            return error;
        }
        q += 4;
        while (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r') q++;
        char *name = q;
        while (is_ident(*q)) q++;
        int name_len = (int)(q - name);
        while (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r') q++;
        if (!name_len || *q != '(') {
            snprintf(error, sizeof error, "error: expected a kernel name and '('");
            return error;
        }
        int map[64], n = 0, depth = 0;
        char *param = ++q;
        for (;; q++) {
            if (!*q) {
                snprintf(error, sizeof error, "error: unterminated parameter list of %.*s",
                         name_len, name);
                return error;
            }
            if (*q == '(' || *q == '[') depth++;
            else if ((*q == ')' || *q == ']') && depth) depth--;
            else if ((*q == ',' || *q == ')') && !depth) {
                char *end = q;
                int blank = 1;
                for (char *c = param; c < end; c++)
                    if (*c != ' ' && *c != '\t' && *c != '\n' && *c != '\r') blank = 0;
                if (!blank) {
                    char *open = strstr(param, "[[");
                    if (!open || open > end) {
                        snprintf(error, sizeof error,
                                 "error: parameter %d of kernel %.*s has no [[buffer(i)]] or "
                                 "[[thread_position_in_grid]] attribute", n, name_len, name);
                        return error;
                    }
                    char *close = strstr(open, "]]");
                    char attr[64] = {0};
                    size_t k = 0;
                    for (char *c = open + 2; c < close && k < sizeof attr - 1; c++)
                        if (*c != ' ' && *c != '\t') attr[k++] = *c;
                    unsigned index;
                    char tail;
                    if (sscanf(attr, "buffer(%u%c", &index, &tail) == 2 && tail == ')' &&
                        index < 31) {
                        map[n] = (int)index;
                    } else if (strcmp(attr, "thread_position_in_grid") == 0) {
                        if (memchr(param, '*', (size_t)(open - param))) {
                            snprintf(error, sizeof error,
                                     "error: the simulation supports only 'uint' positions");
                            return error;
                        }
                        map[n] = -1;
                    } else {
                        snprintf(error, sizeof error,
                                 "error: attribute [[%s]] is not in the simulated subset", attr);
                        return error;
                    }
                    memset(open, ' ', (size_t)(close + 2 - open));  /* C++ sees no attribute */
                    if (++n == 64) {
                        snprintf(error, sizeof error, "error: too many parameters");
                        return error;
                    }
                }
                param = q + 1;
                if (*q == ')') break;
            }
        }
        putf(wrappers, "extern \"C\" const int __asyncmetal_sim_params_%.*s[] = {%d", name_len,
             name, n);
        for (int i = 0; i < n; i++) putf(wrappers, ", %d", map[i]);
        putf(wrappers, "};\nextern \"C\" int __asyncmetal_sim_kernel_%.*s(void **b, "
                       "const unsigned *g) {\n    return __asyncmetal_sim_run(%.*s, "
                       "__asyncmetal_sim_params_%.*s + 1, b, g);\n}\n",
             name_len, name, name_len, name, name_len, name);
        putf(wrappers, "extern \"C\" const int *__asyncmetal_sim_sizes_%.*s(void) {\n"
                       "    return __asyncmetal_sim_sizes(%.*s);\n}\n",
             name_len, name, name_len, name);
        ++*count;
        p = q;
    }
    return NULL;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *data = malloc((size_t)n + 1);
    *len = fread(data, 1, (size_t)n, f);
    data[*len] = 0;
    fclose(f);
    return data;
}

static int write_file(const char *path, const char *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t n = fwrite(data, 1, len, f);
    return fclose(f) || n != len ? -1 : 0;
}

/* The options' macros (-DNAME, -DNAME=VALUE, or -D and the macro as the next option;
 * options are separated by spaces), as the Metal compiler takes them: #define lines. */
static void put_macros(text *unit, const char *options) {
    for (const char *p = options; *p;) {
        while (*p == ' ') p++;
        const char *end = strchrnul(p, ' ');
        if (end - p >= 2 && p[0] == '-' && p[1] == 'D') {
            const char *name = p + 2;
            if (name == end) { /* -D NAME: the macro is the next option */
                for (name = end; *name == ' '; name++) {}
                end = strchrnul(name, ' ');
            }
            const char *eq = memchr(name, '=', (size_t)(end - name));
            if (eq)
                putf(unit, "#define %.*s %.*s\n", (int)(eq - name), name, (int)(end - eq - 1),
                     eq + 1);
            else if (end > name)
                putf(unit, "#define %.*s 1\n", (int)(end - name), name);
        }
        p = end;
    }
}

/* Compiles; returns the library (malloc'd, *len) or NULL with *message (malloc'd). */
static char *compile(const char *source, const char *options, size_t *len, char **message) {
    char dir[] = "/tmp/asyncmetal-sim-XXXXXX";
    if (!mkdtemp(dir)) {
        *message = strdup("cannot make a temporary directory");
        return NULL;
    }
    char path[4][sizeof dir + 32];
    snprintf(path[0], sizeof path[0], "%s/metal_stdlib", dir);
    snprintf(path[1], sizeof path[1], "%s/k.cpp", dir);
    snprintf(path[2], sizeof path[2], "%s/k.so", dir);
    snprintf(path[3], sizeof path[3], "%s/log", dir);
    char *library = NULL;
    char *src = strip_comments(source);
    text wrappers = {0}, unit = {0};
    int count;
    char *error = parse_kernels(src, &wrappers, &count);
    if (error) {
        *message = strdup(error);
    } else {
        put(&unit, "#include <metal_stdlib>\n", 24);
        put_macros(&unit, options);
        put(&unit, "#line 1 \"program.metal\"\n", 24);
        put(&unit, src, strlen(src));
        put(&unit, "\n", 1);
        if (wrappers.len) put(&unit, wrappers.data, wrappers.len);
        write_file(path[0], prelude, sizeof prelude - 1);
        write_file(path[1], unit.data, unit.len);
        const char *cxx = getenv("ASYNCMETAL_SIM_CXX");
        char command[1024];
        snprintf(command, sizeof command,
                 "%s -std=c++17 -O1 -shared -fPIC -w -I'%s' -o '%s' '%s' >'%s' 2>&1",
                 cxx && *cxx ? cxx : "c++", dir, path[2], path[1], path[3]);
        int status = system(command);
        size_t n;
        if (status != 0) {
            char *log = read_file(path[3], &n);
            *message = log ? log : strdup("the C++ compiler failed");
        } else {
            char *so = read_file(path[2], &n);
            library = malloc(n + 8);
            memcpy(library, "MTLB", 4);
            memcpy(library + 4, so, n);
            memcpy(library + 4 + n, "ENDT", 4);
            *len = n + 8;
            free(so);
        }
    }
    for (int i = 0; i < 4; i++) unlink(path[i]);
    rmdir(dir);
    free(src);
    free(wrappers.data);
    free(unit.data);
    return library;
}

/* The warnings the reply carries: one line per __asyncmetal_sim_warning marker. */
static void sim_warnings(const char *source, text *out) {
    static const char marker[] = "__asyncmetal_sim_warning";
    for (const char *p = source; (p = strstr(p, marker));) {
        int line = 1;
        for (const char *c = source; c < p; c++) line += *c == '\n';
        p += sizeof marker - 1;
        const char *end = strchrnul(p, '\n');
        putf(out, "program.metal:%d: warning:%.*s\n", line, (int)(end - p), p);
        p = end;
    }
}

typedef struct { char name[64]; } service;

void *MTLCodeGenServiceCreate(const char *name) {
    service *s = calloc(1, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name ? name : "");
    return s;
}

typedef void (^reply_t)(int32_t error, void *data, size_t length, const char *message);

void MTLCodeGenServiceBuildRequest(void *service, void *unused, int type, const char *request,
                                   size_t length, void *block) {
    (void)unused;
    const struct {
        void *isa; int flags; int reserved; void *invoke;
        struct { unsigned long reserved, size; const char *signature; } *descriptor;
    } *literal = block;
    if (!service || !literal || strcmp(literal->descriptor->signature, "v40@?0i8^v16Q24*32")) {
        fprintf(stderr, "asyncmetal-sim: MTLCodeGenServiceBuildRequest: bad service or block\n");
        abort();
    }
    reply_t reply = Block_copy((reply_t)block);
    uint64_t n_src, n_opt;
    if (type != 13 || length < 16) {
        reply(1, NULL, 0, "unsupported request");
        Block_release(reply);
        return;
    }
    memcpy(&n_src, request, 8);
    memcpy(&n_opt, request + 8, 8);
    if (16 + n_src + n_opt != length || n_src % 4 || !n_src || request[16 + n_src - 1] ||
        !n_opt || request[length - 1] || !strstr(request + 16 + n_src, "-x metal")) {
        reply(2, NULL, 0, "malformed request");
        Block_release(reply);
        return;
    }
    char *message = NULL;
    size_t lib_len = 0;
    char *library = compile(request + 16, request + 16 + n_src, &lib_len, &message);
    if (!library) {
        reply(3, NULL, 0, message);
    } else {
        text warnings = {0};
        sim_warnings(request + 16, &warnings);
        put(&warnings, "", 0);  /* NUL-terminated, as an empty section is */
        uint32_t header = 16, warn = (uint32_t)warnings.len + 1;
        size_t total = 16 + warn + lib_len;
        char *data = calloc(1, total);
        memcpy(data + 8, &header, 4);
        memcpy(data + 12, &warn, 4);
        memcpy(data + 16, warnings.data, warnings.len);
        memcpy(data + 16 + warn, library, lib_len);
        reply(0, data, total, NULL);
        free(data);
        free(warnings.data);
    }
    free(library);
    free(message);
    Block_release(reply);
}
