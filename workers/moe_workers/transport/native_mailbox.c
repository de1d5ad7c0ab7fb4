/* Mailboxes of the shared-memory expert exchange (shm.py): one 64-byte line of a shared mapping
 * per direction of a connection, each with one poster and one waiter.
 *
 *   uint32 seq       bumped by the poster once the frame is in place (a release: the frame's bytes
 *                    are visible to whoever sees the new value)
 *   uint32 sleeping  1 while the waiter is, or is about to be, asleep in futex(FUTEX_WAIT) on seq
 *
 * The poster wakes the waiter only when it sleeps: a post to a waiter that spins is one store and
 * one load, no syscall. Both sides store, then load the other's word, sequentially consistent (the
 * waiter: sleeping, then seq; the poster: seq, then sleeping), so at least one of them sees the
 * other's store: either the waiter finds the new seq and does not sleep, or the poster finds it
 * asleep (or about to be) and wakes it; FUTEX_WAIT itself sleeps only while seq still holds the
 * old value, so a post between the waiter's check and its sleep is not lost either.
 *
 * The words live in a mapping of a memfd both processes hold (MAP_SHARED), so the futex is a
 * shared one (no FUTEX_PRIVATE_FLAG): the kernel keys it by the page, not by the address space.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint32_t seq;
    uint32_t sleeping;
} moe_box;

static inline long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Publish `seq` (the frame before it is in place) and wake the waiter if it sleeps. Returns 1 when
 * it took a wake-up syscall, 0 when the waiter was awake. */
int moe_box_post(moe_box *b, uint32_t seq) {
    __atomic_store_n(&b->seq, seq, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&b->sleeping, __ATOMIC_SEQ_CST))
        return 0;
    syscall(SYS_futex, &b->seq, FUTEX_WAKE, 1, NULL, NULL, 0);
    return 1;
}

/* Wait until seq differs from `old`: poll for `spin_ns` (offering the CPU every 256 polls when
 * `yield` is set), then sleep on the futex until `wait_ns` (from the call) has passed. Returns
 * the seq seen: `old` when the time ran out (the caller checks on its peer and waits again). */
uint32_t moe_box_wait(moe_box *b, uint32_t old, long spin_ns, long wait_ns, int yield) {
    uint32_t s = __atomic_load_n(&b->seq, __ATOMIC_ACQUIRE);
    if (s != old || wait_ns <= 0)
        return s;
    long start = now_ns();
    if (spin_ns > 0) {
        for (unsigned i = 1;; i++) {
            relax();
            s = __atomic_load_n(&b->seq, __ATOMIC_ACQUIRE);
            if (s != old)
                return s;
            if ((i & 255) == 0) {
                if (now_ns() - start >= spin_ns)
                    break;
                if (yield)
                    sched_yield();
            }
        }
    }
    __atomic_store_n(&b->sleeping, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        s = __atomic_load_n(&b->seq, __ATOMIC_SEQ_CST);
        if (s != old)
            break;
        long left = wait_ns - (now_ns() - start);
        if (left <= 0)
            break;
        struct timespec ts = {left / 1000000000L, left % 1000000000L};
        syscall(SYS_futex, &b->seq, FUTEX_WAIT, old, &ts, NULL, 0); /* EAGAIN: seq moved already */
    }
    __atomic_store_n(&b->sleeping, 0, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&b->seq, __ATOMIC_ACQUIRE);
}
