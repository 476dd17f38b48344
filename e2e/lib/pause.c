/* The pod sandbox's process: holds the pod's namespaces, reaps orphans,
 * and exits on SIGINT or SIGTERM. */
#include <signal.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction down = {.sa_handler = stop};
    struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    sigaction(SIGINT, &down, NULL);
    sigaction(SIGTERM, &down, NULL);
    sigaction(SIGCHLD, &child, NULL);
    for (;;)
        pause();
}
