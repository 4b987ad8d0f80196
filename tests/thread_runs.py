"""Streams of model calls run alone and then in threads at once: what the thread-safety tests compare."""

import threading


def alone_and_together(call, streams, reset):
    """Each stream of ``streams`` (a list of call arguments) run alone, one stream after another, then every stream
    at once in a thread of its own, each call waiting at a barrier for the other threads' calls. ``reset()`` starts
    a stream (in its thread), ``call(args)`` makes one call and returns its output. Returns ``(alone, together)``,
    the outputs per stream; an exception in a thread is raised here."""

    def generate(stream, out, barrier=None):
        reset()
        for args in stream:
            if barrier is not None:
                barrier.wait()
            out.append(call(args))

    alone = [[] for _ in streams]
    for stream, out in zip(streams, alone):
        generate(stream, out)
    together, errors, barrier = [[] for _ in streams], [], threading.Barrier(len(streams))

    def work(stream, out):
        try:
            generate(stream, out, barrier)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(s, o)) for s, o in zip(streams, together)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    assert [len(out) for out in together] == [len(stream) for stream in streams]
    return alone, together
