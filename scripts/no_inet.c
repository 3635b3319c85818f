/* An LD_PRELOAD shim that refuses internet sockets, as the TPU host's sandbox does.
 *
 * socket(AF_INET | AF_INET6, ...) fails with EAFNOSUPPORT (errno 97, what that host answers); unix domain sockets
 * and everything else pass through. scripts/no_inet.sh builds it and runs a command under it, so the suite's
 * "no TCP" paths (every service over unix sockets) can be exercised on any Linux machine. Statically linked
 * programs (kubectl) make their system calls directly and are not affected.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>

int socket(int domain, int type, int protocol) {
    static int (*real_socket)(int, int, int);
    if (domain == AF_INET || domain == AF_INET6) {
        errno = EAFNOSUPPORT;
        return -1;
    }
    if (!real_socket) real_socket = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    return real_socket(domain, type, protocol);
}
